"""Dropout driven by the train step's key (``model.embed_pdrop``, ``resid_pdrop``, ``attn_pdrop``).

The train step hands the loss a fresh key each step (split from ``TrainerState.key``, so a
run's masks follow from ``trainer.seed`` and the step); the model splits it per layer and
per site. Evaluation and generation pass no key, and then nothing is dropped; a rate of 0
drops nothing and draws nothing, so a run with every rate 0 traces as it would without
dropout.
"""

from __future__ import annotations

from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from loomax.config import ConfigError

PDROP_KEYS = ("embed_pdrop", "resid_pdrop", "attn_pdrop")
"""The ``model`` keys of the dropout rates."""


def check_rates(config: Any) -> None:
    """Raise ``ConfigError`` naming the key for a rate of ``config`` (an ``LmConfig``) outside [0, 1)."""
    for name in PDROP_KEYS:
        rate = getattr(config, name)
        if not 0.0 <= rate < 1.0:
            raise ConfigError(f"model.{name} must be in [0, 1), got {rate}")


def dropout(x: Any, rate: float, key: PRNGKeyArray | None) -> Any:
    """``x`` (a ``NamedArray`` or array) with a fraction ``rate`` of its entries zeroed and
    the rest scaled by ``1 / (1 - rate)``; ``x`` itself when ``key`` is None or ``rate`` 0."""
    if key is None or rate == 0.0:
        return x
    array = x.array if isinstance(x, hax.NamedArray) else x
    keep = jax.random.bernoulli(key, 1.0 - rate, array.shape)
    out = jnp.where(keep, array / jnp.asarray(1.0 - rate, array.dtype), jnp.zeros_like(array))
    return hax.named(out, x.axes) if isinstance(x, hax.NamedArray) else out


def split(key: PRNGKeyArray | None, n: int) -> tuple[PRNGKeyArray | None, ...]:
    """``n`` independent keys from ``key``, or ``n`` Nones without one."""
    if key is None:
        return (None,) * n
    return tuple(jax.random.split(key, n))


ADAPTER_SALT = 0x10AA
"""Folded into a site's key to draw its linear layers' adapter dropout keys (``models/lora``),
so that the sites' own masks stay what they were without adapters."""


def adapter_keys(key: PRNGKeyArray | None, n: int) -> tuple[PRNGKeyArray | None, ...]:
    """``n`` keys for the linear layers of a site whose key is ``key`` (their LoRA adapters'
    dropout; a plain ``Linear`` ignores its key), or ``n`` Nones without one."""
    if key is None:
        return (None,) * n
    return split(jax.random.fold_in(key, ADAPTER_SALT), n)
