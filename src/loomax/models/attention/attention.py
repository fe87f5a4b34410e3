"""Causal self-attention on named axes, shared by every model, with selectable backends.

Backends (``attn_backend``):

- ``vanilla`` (``vanilla.py``): queries in blocks of ``QUERY_BLOCK``, each block against the
  keys up to its own end (the fully masked part of the causal square is never computed);
  fast at short sequence lengths.
- ``blockwise``: flash-style, pure JAX (``loomax.models.attention.flash``): O(seq) memory.
- ``splash``: the Pallas TPU splash-attention kernel, run per device under ``shard_map``
  (``splash.py``); blocks of ``splash_block_q`` x ``splash_block_kv``. Off TPU it runs in
  Pallas's interpret mode (correct, slow: for tests).
- ``xla`` / ``cudnn``: ``jax.nn.dot_product_attention`` with that implementation (``xla``
  runs everywhere; ``cudnn`` needs an NVIDIA GPU and float16/bfloat16 inputs).
- ``auto``: on TPU (the devices being compiled for) ``splash`` where the sequence splits
  into its blocks; on GPU ``cudnn`` where cuDNN's fused attention can serve (compute
  capability 8.0 or later, bfloat16/float16, a head size that is a multiple of 8 and at
  most 128, or 256 from Hopper on; with document masks, an even sequence length); else
  ``blockwise`` for sequences longer than ``BLOCKWISE_FROM`` and ``vanilla`` below.
  ``cudnn_unsupported_reason`` and ``splash_unsupported_reason`` say why a kernel cannot
  serve a case.

When the compute mapping splits ``position`` over the ``context`` mesh axis, context-parallel
attention (``ring_attention.py``, ``model.context_parallel``) takes over on the zig-zag layout;
its per-block kernel is blockwise, or splash for the ring where the backend is ``splash``
(``auto`` stays blockwise there): ``ring_kernel``.

Every backend takes optional ``segment_ids`` (axes ``(..., position)``): a query only sees
keys of its own segment, which keeps packed documents apart (see ``segment_ids_from_eos``),
and an optional sliding ``window``: a query sees only the keys fewer than ``window``
positions back (itself included), as Mistral; ``vanilla`` and ``blockwise`` skip the key
blocks wholly outside it, splash uses its local mask, ``xla``/``cudnn`` their local window.
Keys may have fewer heads than queries (grouped-query attention: a ``kv_heads`` axis).
Attention sinks (one logit per head in the softmax's denominator: ``sinks.py``) run on
``vanilla``, ``blockwise``, ``splash``, the blockwise ring and decoding. While QK-clip collects
them (``max_logits.py``), ``vanilla`` and ``blockwise`` report each head's largest logit.
"""

from __future__ import annotations

import math
from typing import Protocol

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from loomax.config import ConfigError
from loomax.mesh import target_platform
from loomax.models.attention import max_logits
from loomax.models.attention.cudnn_packed import jax_attention
from loomax.models.attention.flash import flash_attention, flash_attention_with_max
from loomax.models.attention.ring_attention import context_parallel_attention
from loomax.models.attention.sequence_layout import context_ways
from loomax.models.attention.sinks import refuse_sinks, sink_array
from loomax.models.attention.splash import splash_attention, splash_unsupported_reason
from loomax.models.attention.vanilla import (  # noqa: F401 (re-exported)
    BLOCKWISE_FROM,
    CAPPING_BACKENDS,
    QUERY_BLOCK,
    attend,
    blocked_causal,
    softcap_backend,
)
from loomax.models.axes import Heads, HeadSize, KeyPosition, KvHeads, Position

BACKENDS = ("auto", "vanilla", "blockwise", "splash", "xla", "cudnn")
FLASH_BLOCK = 256
"""Default query and key block of ``blockwise`` (``model.flash_attention_block_size``): on
CPU a Llama step at 4,096-8,192 positions ran 1.3-1.4x faster than with 128, 512 slower."""
SPLASH_BLOCKS = (512, 512)
"""Default query and key blocks of the ``splash`` backend (``model.splash_block_q/kv``)."""


def segment_ids_from_eos(tokens: NamedArray, eos_id: int) -> NamedArray:
    """Document index of each position in a packed sequence: an EOS ends its document."""
    is_eos = (tokens == eos_id).astype(jnp.int32)
    return hax.cumsum(is_eos, Position) - is_eos


def gpu_compute_capability() -> tuple[int, int] | None:
    """The CUDA compute capability of the default device, or None off NVIDIA GPUs."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    if not capability:
        return None
    major, minor = (int(p) for p in str(capability).split(".")[:2])
    return major, minor


def cudnn_unsupported_reason(
    dtype,
    head_size: int,
    seq_len: int,
    *,
    segments: bool = False,
    compute_capability: tuple[int, int] | None = None,
) -> str | None:
    """Why cuDNN's fused attention cannot run this case, or None if it can.

    ``compute_capability`` is the GPU's (``gpu_compute_capability()``); None means no
    NVIDIA GPU. The limits are those of the cuDNN flash-attention kernels JAX calls.
    """
    if compute_capability is None:
        return "no NVIDIA GPU (cuDNN attention runs on CUDA devices only)"
    if compute_capability < (8, 0):
        return f"compute capability {compute_capability[0]}.{compute_capability[1]} < 8.0"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"dtype {jnp.dtype(dtype).name} (cuDNN takes bfloat16 or float16)"
    max_head = 256 if compute_capability >= (9, 0) else 128
    if head_size % 8 or head_size > max_head:
        return f"head size {head_size} (must be a multiple of 8 and at most {max_head})"
    if segments and seq_len % 2:
        return f"document masks with an odd sequence length ({seq_len})"
    return None


def resolve_backend(
    backend: str,
    dtype,
    seq_len: int,
    head_size: int = 64,
    *,
    segments: bool = False,
    compute_capability: tuple[int, int] | None | str = "detect",
    platform: str = "detect",
    splash_blocks: tuple[int, int] = SPLASH_BLOCKS,
) -> str:
    """The backend ``auto`` stands for here (others are returned as they are).

    ``platform`` is that of the devices compiled for (``detect``: the mesh in context).
    ``cudnn`` or ``splash`` asked for where it cannot serve raises ``ConfigError`` saying why.
    """
    if backend == "splash":
        reason = splash_unsupported_reason(seq_len, *splash_blocks)
        if reason:
            raise ConfigError(f"model.attn_backend splash cannot serve this attention: {reason}")
        return backend
    if backend not in ("auto", "cudnn"):
        return backend
    if backend == "auto":
        if platform == "detect":
            platform = target_platform()
        if platform == "tpu" and splash_unsupported_reason(seq_len, *splash_blocks) is None:
            return "splash"
    if compute_capability == "detect":
        compute_capability = gpu_compute_capability()
    reason = cudnn_unsupported_reason(
        dtype, head_size, seq_len, segments=segments, compute_capability=compute_capability
    )
    if backend == "cudnn":
        if reason:
            raise ConfigError(f"model.attn_backend cudnn cannot serve this attention: {reason}")
        return backend
    if reason is None:
        return "cudnn"
    return "blockwise" if seq_len > BLOCKWISE_FROM else "vanilla"


class AttentionSettings(Protocol):
    """What ``model_attention`` reads of a model config (``LmConfig`` has them all)."""

    attn_backend: str
    splash_blocks: tuple[int, int]
    flash_block: int
    attn_pdrop: float
    cudnn_packed_documents: int
    context_parallel: str


def model_attention(
    config: AttentionSettings,
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    segment_ids: NamedArray | None = None,
    *,
    key: jax.Array | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """``causal_attention`` of ``q`` over ``k`` and ``v`` (all on ``position``; the keys and
    values are renamed to ``key_position`` here) with a model config's backend, blocks and
    attention dropout (``attn_backend``, ``splash_blocks``, ``flash_block``, ``attn_pdrop``),
    within a sliding ``window``, scores times ``scale``, soft-capped and with ``sinks`` when given."""
    k, v = k.rename({Position: KeyPosition}), v.rename({Position: KeyPosition})
    return causal_attention(
        q,
        k,
        v,
        backend=config.attn_backend,
        segment_ids=segment_ids,
        splash_blocks=config.splash_blocks,
        flash_block=config.flash_block,
        dropout_rate=config.attn_pdrop,
        key=key,
        cudnn_documents=config.cudnn_packed_documents,
        context_parallel=config.context_parallel,
        window=window,
        scale=scale,
        softcap=softcap,
        sinks=sinks,
    )


def causal_attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    *,
    backend: str = "auto",
    segment_ids: NamedArray | None = None,
    splash_blocks: tuple[int, int] = SPLASH_BLOCKS,
    flash_block: int = FLASH_BLOCK,
    dropout_rate: float = 0.0,
    key: jax.Array | None = None,
    cudnn_documents: int = 0,
    context_parallel: str = "ring",
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """Scaled dot-product causal self-attention (within a sliding ``window`` when given).

    ``scale`` multiplies the scores (default ``1 / sqrt(head_size)``); ``softcap`` caps them
    at ``softcap * tanh(scores / softcap)`` (Gemma 2), which ``vanilla`` and ``blockwise``
    compute: ``auto`` then picks one of them by length, another backend raises ``ConfigError``.

    ``q`` has axes ``(..., position, heads, head_size)``; ``k`` and ``v`` have
    ``key_position`` for ``position`` and ``heads`` or ``kv_heads`` (dividing ``heads``).
    Scores and softmax are in at least float32; the result has ``q``'s axes and dtype.
    ``flash_block`` is the ``blockwise`` backend's block. With ``key`` and a positive
    ``dropout_rate`` the probabilities are dropped out, which only ``vanilla`` forms:
    ``auto`` then means ``vanilla``, another backend raises ``ConfigError``. On ``cudnn``
    with ``segment_ids``, ``cudnn_documents > 0`` attends through cuDNN's packed-sequence
    kernel when no row has more documents than that (``models/attention/cudnn_packed.py``).
    With the sequence split (``context_ways() > 1``), ``context_parallel`` attention instead.
    ``sinks`` (axis ``heads``): each head's sink logit (gpt-oss; ``sinks.py``), on the
    backends of ``sinks.SINK_BACKENDS`` (``auto`` picks none of the others).
    """
    drop = None
    if key is not None and dropout_rate > 0:
        if backend not in ("auto", "vanilla"):
            raise ConfigError(
                f"model.attn_pdrop needs model.attn_backend auto or vanilla, got {backend!r}"
            )
        backend, drop = "vanilla", (dropout_rate, key)
    qa, ka, va, batch_axes = _to_arrays(q, k, v)
    B, T, S = qa.shape[0], qa.shape[3], ka.shape[2]
    if S != T:
        raise ValueError("causal_attention is self-attention: key_position must match position")
    seg = None
    if segment_ids is not None:
        seg = segment_ids.rearrange((*batch_axes, Position)).array.reshape(B, T)
    scale = 1 / math.sqrt(qa.shape[-1]) if scale is None else scale
    sink = sink_array(sinks, ka.shape[1])
    if sink is not None:
        refuse_sinks(backend)
    if softcap is not None:
        backend = softcap_backend(backend, T)
    peak = max_logits.active()
    if peak:
        backend = softcap_backend(backend, T, "QK-clip (optimizer.qk_clip_tau)")
        why = max_logits.refuse_reason(
            backend, context=context_ways() > 1, softcap=softcap is not None, sinks=sink is not None
        )
        if why:
            raise ConfigError(f"QK-clip (optimizer.qk_clip_tau) cannot read the logits of {why}")
    if context_ways() > 1:
        if softcap is not None:
            raise ConfigError(
                "attention soft-capping is not supported with trainer.mesh.context > 1"
            )
        if drop is not None:
            raise ConfigError("model.attn_pdrop > 0 is not supported with trainer.mesh.context > 1")
        if window is not None:
            raise ConfigError(
                "model.sliding_window is not supported with trainer.mesh.context > 1 "
                "(context-parallel attention is full causal)"
            )
        out = context_parallel_attention(
            qa, ka, va, seg, scale, flash_block, context_parallel, backend, splash_blocks, sink
        )
        return _from_array(out, q, batch_axes)
    backend = resolve_backend(
        backend, qa.dtype, T, qa.shape[-1], segments=seg is not None, splash_blocks=splash_blocks,
        **({} if sink is None else {"compute_capability": None}),  # sinks: no cuDNN
    )  # fmt: skip
    if backend == "vanilla":
        qs = qa * jnp.asarray(scale, qa.dtype)
        out = blocked_causal(qs, ka, va, seg, drop, window, softcap, sink, peak)
    elif backend == "blockwise":
        if seg is None:
            seg = jnp.zeros((B, T), jnp.int32)
        if peak:
            out = flash_attention_with_max(qa, ka, va, seg, scale, min(flash_block, T), window)
        else:
            out = flash_attention(
                qa, ka, va, seg, scale, min(flash_block, T), window, softcap, sink
            )
    elif backend == "splash":
        out = splash_attention(qa, ka, va, seg, scale, *splash_blocks, window=window, sink=sink)
    elif backend in ("xla", "cudnn"):
        out = jax_attention(qa, ka, va, seg, backend, cudnn_documents, window, scale)
    else:
        raise ValueError(f"model.attn_backend must be one of {BACKENDS}, got {backend!r}")
    if peak:
        out, most = out
        max_logits.report(hax.named(jnp.max(most, axis=0).reshape(-1), (q.resolve_axis(Heads),)))
    return _from_array(out, q, batch_axes)


def cached_attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    cache_k: NamedArray,
    cache_v: NamedArray,
    start: jax.Array,
    window: int | jax.Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: NamedArray | None = None,
) -> tuple[NamedArray, NamedArray, NamedArray]:
    """Attention for incremental decoding with a KV cache: returns ``(out, cache_k, cache_v)``.

    ``q``, ``k``, ``v`` hold new positions ``start, start + 1, ...`` (axis ``position``);
    ``cache_k``/``cache_v`` hold all ``key_position`` slots. The new keys and values are
    written at ``start``, and each query sees every cached key at or before its position
    (and fewer than ``window`` positions back, when given; here ``window`` may be traced);
    ``scale``, ``softcap`` and ``sinks`` as in ``causal_attention``.
    """
    k = k.rename({Position: KeyPosition})
    v = v.rename({Position: KeyPosition})
    cache_k = hax.updated_slice(cache_k, {KeyPosition: start}, k.rearrange(cache_k.axes))
    cache_v = hax.updated_slice(cache_v, {KeyPosition: start}, v.rearrange(cache_v.axes))
    qa, ka, va, batch_axes = _to_arrays(q, cache_k, cache_v)
    scale = jnp.asarray(1 / math.sqrt(qa.shape[-1]) if scale is None else scale, qa.dtype)
    sink = sink_array(sinks, ka.shape[1])
    out = attend(qa * scale, ka, va, start, None, None, None, 0, window, softcap, sink)
    return _from_array(out, q, batch_axes), cache_k, cache_v


# ------------------------------------------------------------------ layout helpers
def _to_arrays(q: NamedArray, k: NamedArray, v: NamedArray):
    """``q -> [B, kv_heads, group, T, D]``, ``k, v -> [B, kv_heads, S, D]`` (B = all batch axes)."""
    batch_axes = tuple(a for a in q.axes if a.name not in (Position, Heads, HeadSize))
    H, D = q.resolve_axis(Heads), q.resolve_axis(HeadSize)
    KvAxis = k.resolve_axis(KvHeads) if k.has_axis(KvHeads) else k.resolve_axis(Heads)
    if H.size % KvAxis.size:
        raise ValueError(f"{H.size} query heads are not a multiple of {KvAxis.size} kv heads")
    B = math.prod(a.size for a in batch_axes)
    T = q.resolve_axis(Position).size
    qa = q.rearrange((*batch_axes, H, q.resolve_axis(Position), D)).array
    qa = qa.reshape(B, KvAxis.size, H.size // KvAxis.size, T, D.size)
    kv_order = (*batch_axes, KvAxis, k.resolve_axis(KeyPosition), D)
    ka = k.rearrange(kv_order).array.reshape(B, KvAxis.size, -1, D.size)
    va = v.rearrange(kv_order).array.reshape(B, KvAxis.size, -1, D.size)
    return qa, ka, va, batch_axes


def _from_array(out: jax.Array, q: NamedArray, batch_axes) -> NamedArray:
    order = (*batch_axes, q.resolve_axis(Heads), q.resolve_axis(Position), q.resolve_axis(HeadSize))
    out = out.reshape(tuple(a.size for a in order))
    return hax.named(out, order).rearrange(q.axes)
