"""Loomax: a named-axis training stack for language models in JAX."""

from loomax._jax_compat import apply_jax_compat
from loomax._xla_flags import apply_default_xla_flags
from loomax.jax_setup import choose_platforms

apply_default_xla_flags()
apply_jax_compat()
choose_platforms()


def __getattr__(name: str):
    if name == "load_model":  # loomax.load_model(dir), imported on first use (it pulls in JAX)
        from loomax.models.io.saving import load_model

        return load_model
    raise AttributeError(f"module 'loomax' has no attribute {name!r}")
