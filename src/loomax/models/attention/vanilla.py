"""The ``vanilla`` attention backend: queries in blocks of ``QUERY_BLOCK``, each against the keys
up to its own end (the fully masked part of the causal square is never computed), scores and
softmax whole per block; with dropout of the probabilities, soft-capped scores, sinks and, on
request, each head's largest visible score (QK-clip). ``_attend`` also serves decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from loomax.config import ConfigError
from loomax.models.attention.flash import acc_dtype, visible_mask
from loomax.models.attention.sinks import sink_softmax
from loomax.models.blocks.dropout import dropout

QUERY_BLOCK = 128
"""Query block of the ``vanilla`` backend."""
CAPPING_BACKENDS = ("vanilla", "blockwise")
"""The backends that soft-cap attention scores (Gemma 2); splash, xla and cudnn do not here."""
BLOCKWISE_FROM = 2048
"""``auto`` picks ``blockwise`` (on CPU/TPU) for sequences longer than this."""


def softcap_backend(
    backend: str, seq_len: int, why: str = "attention soft-capping (Gemma 2)"
) -> str:
    """The backend for soft-capped scores (or another need ``why`` only ``vanilla`` and
    ``blockwise`` meet): one of them; ``auto``: by length as off the kernels."""
    if backend == "auto":
        return "blockwise" if seq_len > BLOCKWISE_FROM else "vanilla"
    if backend not in CAPPING_BACKENDS:
        raise ConfigError(
            f"{why} needs model.attn_backend auto, vanilla or blockwise, got {backend!r}"
        )
    return backend


def blocked_causal(q, k, v, seg, drop=None, window=None, softcap=None, sink=None, peak=False):
    """Causal attention of pre-scaled ``q [B, K, G, T, D]`` over ``k``/``v [B, K, T, D]`` by
    query blocks; ``peak``: also each head's largest visible score ``[B, K, G]``."""
    seq = q.shape[-2]
    block = min(QUERY_BLOCK, seq)
    outs, peaks = [], []
    for start in range(0, seq, block):
        stop = min(start + block, seq)
        first = 0 if window is None else max(0, start - window + 1)  # the block's first key
        q_seg = None if seg is None else seg[:, start:stop]
        k_seg = None if seg is None else seg[:, first:stop]
        block_drop = None if drop is None else (drop[0], jax.random.fold_in(drop[1], start))
        qkv = (q[..., start:stop, :], k[..., first:stop, :], v[..., first:stop, :])
        out = attend(*qkv, start, q_seg, k_seg, block_drop, first, window, softcap, sink, peak)
        outs.append(out[0] if peak else out)
        peaks += [out[1]] if peak else []
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-2)
    return (out, jnp.max(jnp.stack(peaks), axis=0)) if peak else out


def attend(
    q, k, v, q_start, q_seg, k_seg, drop=None, k_start=0, window=None, softcap=None, sink=None,
    peak=False,
):  # fmt: skip
    """Softmax attention of (pre-scaled) ``q`` at positions ``q_start + i`` over keys at
    ``k_start + j``; ``drop`` = ``(rate, key)`` drops out probabilities; ``sink [K, G]``;
    ``peak``: ``(out, the largest visible score per head [B, K, G])``."""
    acc = acc_dtype(q.dtype)
    scores = jnp.einsum("bkgqd,bksd->bkgqs", q, k, preferred_element_type=acc)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    q_pos = q_start + jnp.arange(q.shape[-2])
    visible = visible_mask(q_pos, k_start + jnp.arange(k.shape[-2]), q_seg, k_seg, window)
    scores = jnp.where(visible, scores, jnp.finfo(acc).min)
    weights = sink_softmax(scores, sink).astype(v.dtype)
    if drop is not None:
        weights = dropout(weights, *drop)
    out = jnp.einsum("bkgqs,bksd->bkgqd", weights, v)
    return (out, jnp.max(scores, axis=(-2, -1))) if peak else out
