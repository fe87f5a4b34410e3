"""Shims that keep Loomax's dependencies working on JAX releases newer than they know.

haliax 1.4.dev453 (the newest release) calls ``jax.core.is_constant_dim``, which JAX 0.11
removed from its public ``jax.core`` (it lives on in ``jax._src.core``): every named einsum
then fails. On JAX 0.11 and later the name is put back, pointing at JAX's own function.
Nothing is changed on older JAX, and JAX is not imported there (``loomax --help`` stays fast).
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version


def installed_version(package: str) -> tuple[int, ...]:
    """The first three numbers of ``package``'s installed version; () if it is not installed."""
    try:
        return tuple(int(p) for p in re.findall(r"\d+", version(package))[:3])
    except PackageNotFoundError:
        return ()


def apply_jax_compat() -> list[str]:
    """Restore the public JAX names Loomax's dependencies still use; returns those restored."""
    if installed_version("jax") < (0, 11):
        return []
    import jax
    import jax._src.core as jax_core

    restored = []
    for name in ("is_constant_dim",):
        if not hasattr(jax.core, name) and hasattr(jax_core, name):
            setattr(jax.core, name, getattr(jax_core, name))
            restored.append(f"jax.core.{name}")
    return restored
