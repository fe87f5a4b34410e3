"""The Gated DeltaNet layer as Qwen3-Next has it, around the gated delta rule (``gated_delta.py``).

``x`` is projected to queries, keys, values and the output gate ``z`` (one fused projection,
grouped per key head as transformers' ``in_proj_qkvz``) and to ``b``, ``a`` per value head
(``in_proj_ba``); queries, keys and values go through a short causal depthwise convolution
(``conv_kernel`` taps, no bias) and SiLU; queries and keys are L2-normalised (queries also
times ``dk ** -0.5``) and repeated from the key heads to the value heads; ``beta =
sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt_bias)``; the rule's output is RMS-normed per
head, times SiLU(z) (the gated norm), and projected back (``out_proj``).

Training (``__call__``) runs the chunked rule; ``segment_ids`` (packed documents) reset the
rule's state and keep the convolution from reading across a document boundary. Decoding
(``decode``) carries a ``DeltaCache``: the last ``conv_kernel - 1`` conv inputs and the rule's
state, a constant size whatever the position (``cache_bytes``). Plain arrays ``[B, T, D]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from loomax.models.blocks.gated_delta import chunked_gated_delta, gated_delta_step


class DeltaCache(NamedTuple):
    """What decoding a Gated DeltaNet layer carries: ``conv [B, conv_kernel - 1, channels]``
    (the last inputs of the convolution) and ``state [B, value_heads, dk, dv]``."""

    conv: jax.Array
    state: jax.Array


def cache_bytes(cache: DeltaCache) -> int:
    """The cache's array bytes (the same at every position)."""
    return sum(a.size * a.dtype.itemsize for a in cache)


class GatedDeltaNet(eqx.Module):
    """Qwen3-Next's linear-attention layer (see the module docstring)."""

    in_proj_qkvz: jax.Array  # [D, key heads x (2 dk + 2 dv x ratio)]
    in_proj_ba: jax.Array  # [D, key heads x 2 ratio]
    conv: jax.Array  # [conv_kernel, channels]: depthwise taps, oldest first
    dt_bias: jax.Array  # [value heads]
    a_log: jax.Array  # [value heads]
    norm: jax.Array  # [dv]: the gated RMSNorm's scale
    out_proj: jax.Array  # [value heads x dv, D]
    key_heads: int = eqx.field(static=True)
    value_heads: int = eqx.field(static=True)
    dk: int = eqx.field(static=True)
    dv: int = eqx.field(static=True)
    chunk: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    @staticmethod
    def init(
        hidden: int, key_heads: int, value_heads: int, dk: int, dv: int, *, conv_kernel: int = 4,
        chunk: int = 64, eps: float = 1e-6, key,
    ) -> GatedDeltaNet:  # fmt: skip
        if value_heads % key_heads:
            raise ValueError(
                f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})"
            )
        r = value_heads // key_heads
        ks = jax.random.split(key, 5)
        channels = 2 * key_heads * dk + value_heads * dv
        normal = lambda k, s, fan: jax.random.normal(k, s) / math.sqrt(fan)  # noqa: E731
        return GatedDeltaNet(
            normal(ks[0], (hidden, key_heads * (2 * dk + 2 * dv * r)), hidden),
            normal(ks[1], (hidden, key_heads * 2 * r), hidden),
            normal(ks[2], (conv_kernel, channels), conv_kernel),
            jnp.ones(value_heads),
            jnp.log(jax.random.uniform(ks[3], (value_heads,), minval=0.01, maxval=16)),
            jnp.ones(dv),
            normal(ks[4], (value_heads * dv, hidden), value_heads * dv),
            key_heads, value_heads, dk, dv, chunk, eps,
        )  # fmt: skip

    def _inputs(self, x):
        """``(qkv channels [B, T, C], z, b, a)`` of ``x [B, T, D]`` in transformers' grouping."""
        B, T, _ = x.shape
        hk, r, dk, dv = self.key_heads, self.value_heads // self.key_heads, self.dk, self.dv
        qkvz = (x @ self.in_proj_qkvz).reshape(B, T, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        ba = (x @ self.in_proj_ba).reshape(B, T, hk, 2 * r)
        b, a = ba[..., :r].reshape(B, T, -1), ba[..., r:].reshape(B, T, -1)
        flat = [a_.reshape(B, T, -1) for a_ in (q, k, v)]
        return jnp.concatenate(flat, -1), z.reshape(B, T, -1, dv), b, a

    def _rule_inputs(self, mixed, b, a):
        B, T, _ = mixed.shape
        kd = self.key_heads * self.dk
        q, k, v = jnp.split(mixed, [kd, 2 * kd], axis=-1)
        q, k = (u.reshape(B, T, self.key_heads, self.dk) for u in (q, k))
        q, k = (u / jnp.sqrt(jnp.sum(u * u, -1, keepdims=True) + 1e-6) for u in (q, k))
        r = self.value_heads // self.key_heads
        q, k = (jnp.repeat(u, r, axis=2) for u in (q, k))
        g = -jnp.exp(self.a_log) * jax.nn.softplus(a + self.dt_bias)
        return q / math.sqrt(self.dk), k, v.reshape(B, T, -1, self.dv), g, jax.nn.sigmoid(b)

    def _out(self, o, z):
        B, T = o.shape[:2]
        var = jnp.mean(o * o, -1, keepdims=True)
        o = o * jax.lax.rsqrt(var + self.eps) * self.norm * jax.nn.silu(z)
        return o.reshape(B, T, -1) @ self.out_proj

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """``[B, T, D]`` for ``x [B, T, D]``; ``segment_ids [B, T]`` (packed documents) or None."""
        mixed, z, b, a = self._inputs(x)
        T, taps = x.shape[1], self.conv.shape[0]
        doc = jnp.zeros(x.shape[:2], jnp.int32) if segment_ids is None else segment_ids
        conv = jnp.zeros_like(mixed)
        for lag in range(taps):  # tap ``taps - 1 - lag`` reads the input ``lag`` positions back
            past = jnp.pad(mixed, [(0, 0), (lag, 0), (0, 0)])[:, :T]
            same = jnp.pad(doc, [(0, 0), (lag, 0)], constant_values=-1)[:, :T] == doc
            conv = conv + jnp.where(same[..., None], past, 0) * self.conv[taps - 1 - lag]
        reset = jnp.concatenate([jnp.ones_like(doc[:, :1], bool), doc[:, 1:] != doc[:, :-1]], 1)
        q, k, v, g, beta = self._rule_inputs(jax.nn.silu(conv), b, a)
        o, _ = chunked_gated_delta(q, k, v, g, beta, self.chunk, reset=reset)
        return self._out(o, z)

    def init_cache(self, batch: int, dtype=jnp.float32) -> DeltaCache:
        channels = self.conv.shape[1]
        return DeltaCache(
            jnp.zeros((batch, self.conv.shape[0] - 1, channels), dtype),
            jnp.zeros((batch, self.value_heads, self.dk, self.dv), dtype),
        )

    def decode(self, x: jax.Array, cache: DeltaCache) -> tuple[jax.Array, DeltaCache]:
        """One position ``x [B, 1, D]`` from ``cache``: ``(out [B, 1, D], the next cache)``."""
        mixed, z, b, a = self._inputs(x)
        window = jnp.concatenate([cache.conv, mixed], axis=1)  # [B, taps, C]
        conv = jnp.einsum("btc,tc->bc", window, self.conv)[:, None]
        q, k, v, g, beta = self._rule_inputs(jax.nn.silu(conv), b, a)
        state, o = gated_delta_step(cache.state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
        return self._out(o[:, None], z), DeltaCache(window[:, 1:], state)
