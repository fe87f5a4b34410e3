"""Attention sinks (gpt-oss): one learned logit per query head in the softmax's denominator.

A sink is a key every query sees whose score is the head's ``sink`` and whose value is
zero: ``softmax`` over ``[scores, sink]`` with the sink's column dropped, so a head may give
a query's keys less than all of its weight. Every backend that has them computes exactly that:

- ``vanilla`` and decoding (``sink_softmax``): the sink's column beside the scores;
- ``blockwise`` and the blockwise ring: the online softmax starts from the sink
  (``sink_state``: running max ``sink``, sum 1, output 0) instead of from nothing, so the
  log-sum-exp of a query includes it; the backward needs no change for ``q``, ``k``, ``v``
  (their probabilities are ``exp(s - lse)`` with that log-sum-exp), and the sink's own
  gradient is ``-sum over queries of exp(sink - lse) * rowsum(dO * O)`` (``sink_grad``);
- ``splash``: JAX's splash kernel's own ``sinks`` (it starts its running max from them).

``xla`` and ``cudnn`` (``jax.nn.dot_product_attention``) and the splash ring have none and
are refused by name (``refuse_sinks``). Sinks are ``[K, G]`` float32 arrays here, the kv-major
order of the query heads (``attention._to_arrays``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from haliax import NamedArray

from loomax.config import ConfigError
from loomax.models.axes import Heads

SINK_BACKENDS = ("auto", "vanilla", "blockwise", "splash")
"""The ``model.attn_backend`` values that take attention sinks."""


def sink_array(sinks: NamedArray | None, kv_heads: int) -> jax.Array | None:
    """``sinks`` (axis ``heads``) as a ``[kv_heads, group]`` float32 array, or None."""
    if sinks is None:
        return None
    a = sinks.rearrange((Heads,)).array.astype(jnp.float32)
    return a.reshape(kv_heads, -1)


def refuse_sinks(backend: str) -> None:
    """``ConfigError`` when ``backend`` (``model.attn_backend``) has no attention sinks."""
    if backend not in SINK_BACKENDS:
        raise ConfigError(
            f"attention sinks (gpt-oss) need model.attn_backend one of {SINK_BACKENDS}, "
            f"got {backend!r} (jax.nn.dot_product_attention has no sink)"
        )


def sink_softmax(scores: jax.Array, sink: jax.Array | None) -> jax.Array:
    """Softmax of ``scores [B, K, G, Tq, S]`` over ``S`` with each head's ``sink [K, G]`` as one
    more (valueless) column, that column dropped; a plain softmax without ``sink``."""
    if sink is None:
        return jax.nn.softmax(scores, axis=-1)
    column = jnp.broadcast_to(sink[:, :, None, None].astype(scores.dtype), (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]


def sink_state(sink: jax.Array | None, shape: tuple[int, ...], dtype, min_value):
    """The running max and sum an online softmax over ``shape`` (``[..., B, K, G, Tq]``) starts
    from: the sink's (max ``sink``, sum 1), or none (the lowest value, 0)."""
    if sink is None:
        return jnp.full(shape, min_value, dtype), jnp.zeros(shape, dtype)
    m = jnp.broadcast_to(sink[:, :, None].astype(dtype), shape)
    return m, jnp.ones(shape, dtype)


def sink_grad(sink: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """``d loss / d sink [K, G]`` from each query's log-sum-exp ``lse [B, K, G, Tq]`` (sink
    included) and ``delta = rowsum(dO * O)``: the sink's probability times ``-delta``, summed."""
    p = jnp.exp(sink[None, :, :, None] - lse)
    return -jnp.sum(p * delta, axis=(0, 3)).astype(sink.dtype)
