"""JAX settings a run applies when it starts: the persistent compilation cache and any flags.

``trainer.jax_compilation_cache_dir`` (or ``JAX_COMPILATION_CACHE_DIR``) keeps compiled
steps across restarts, so a job relaunched after a preemption skips its compile;
``trainer.jax_config`` sets arbitrary ``jax.config`` options by name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax

logger = logging.getLogger(__name__)


def check_jax_options(options: Mapping[str, Any], where: str = "trainer.jax_config") -> None:
    """Raise ``ValueError`` naming ``where`` and the option if any name is not a JAX option."""
    known = jax.config.values
    unknown = sorted(name for name in options if name not in known)
    if unknown:
        close = [k for k in known if any(u.removeprefix("jax_") in k for u in unknown)][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ValueError(f"{where}: unknown JAX option(s) {', '.join(unknown)}{hint}")


def apply_jax_settings(cache_dir: str | None, options: Mapping[str, Any]) -> None:
    """Point JAX's persistent compilation cache at ``cache_dir`` (if given), then set ``options``."""
    check_jax_options(options)
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        logger.info("JAX compilation cache: %s", cache_dir)
    for name, value in options.items():
        jax.config.update(name, value)
