"""Loomax: a named-axis training stack for language models in JAX."""

from loomax._xla_flags import apply_default_xla_flags

apply_default_xla_flags()
