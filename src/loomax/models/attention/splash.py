"""The ``splash`` attention backend: the Pallas TPU splash-attention kernel, over the mesh.

XLA cannot partition a Mosaic kernel, so the kernel runs inside ``shard_map``: the batch
split over the mesh axes the ``batch`` axis maps to, heads over those of ``heads`` (when the
query and key heads both divide over them), the sequence whole on each device. Off TPU the
kernel runs in Pallas's interpret mode: the same kernel, correct and slow (for tests).

The kernel's backward residuals (its output and log-sum-exp) carry the checkpoint name
``SPLASH_RESIDUALS``: a remat policy that saves them with the attention output
(``attn_out``) skips the kernel's forward pass when the backward pass recomputes a layer.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from loomax.mesh import current_mesh, mapped_axes, target_platform
from loomax.models.axes import Heads

SPLASH_RESIDUALS = "splash_residuals"
"""Checkpoint name of the kernel's backward residuals (its output and log-sum-exp)."""
LANES = 128
"""Splash blocks and sequence lengths are multiples of this (the TPU's lane width)."""


def splash_unsupported_reason(seq_len: int, block_q: int, block_kv: int) -> str | None:
    """Why the kernel cannot run a self-attention of ``seq_len``, or None if it can."""
    for name, block in (("splash_block_q", block_q), ("splash_block_kv", block_kv)):
        block = min(block, seq_len)
        if block % LANES:
            return f"model.{name} ({block}) must be a multiple of {LANES}"
        if seq_len % block:
            return f"model.seq_len ({seq_len}) must be a multiple of model.{name} ({block})"
    return None


def splash_attention(
    q, k, v, seg, scale: float, block_q: int, block_kv: int, *, window: int | None = None,
    sink: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """Causal attention through the splash kernel (its local mask: a sliding ``window``; its
    ``sinks``: each head's attention sink, ``sink [K, G]``).

    ``q`` is ``[B, K, G, T, D]``, ``k``/``v`` are ``[B, K, T, D]`` (K kv heads, G queries
    each), ``seg`` is ``[B, T]`` document ids or None. Returns ``q``'s shape and dtype.
    """
    B, K, G, T, D = q.shape
    reason = splash_unsupported_reason(T, block_q, block_kv)
    if reason:
        raise ValueError(f"model.attn_backend splash: {reason}")
    qh = (q * np.asarray(scale, q.dtype)).reshape(B, K * G, T, D)  # heads kv-major
    sinks = None if sink is None else sink.reshape(K * G)
    local = functools.partial(
        _local,
        blocks=(min(block_q, T), min(block_kv, T)),
        interpret=target_platform() != "tpu",
        window=window,
    )
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        out = local(qh, k, v, seg, sinks)
    else:
        batch, heads = _mesh_axes(mesh, B, K, K * G)
        spec = P(batch, heads)
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(spec, spec, spec, None if seg is None else P(batch), P(heads)),
            out_specs=spec,
            check_vma=False,  # JAX's Pallas splash kernel declares no varying axes on its outputs
        )(qh, k, v, seg, sinks)
    return out.reshape(B, K, G, T, D)


def _local(q, k, v, seg, sinks=None, *, blocks, interpret, window=None):
    """The kernel over this device's ``[b, heads, T, D]`` queries, one batch row at a time
    (``sinks [heads]`` or None, shared by the rows)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    kernel = _kernel(q.shape[1], q.shape[2], k.shape[2], *blocks, interpret, window)

    def attend(q, k, v, seg, sinks):
        def one(q1, k1, v1, s1, sinks):  # the sinks passed, not closed over (a closed-over
            ids = None if s1 is None else SegmentIds(s1, s1)  # tracer fails to lower)
            return kernel(q1, k1, v1, segment_ids=ids, sinks=sinks)

        if seg is None:
            rows = lambda q1, k1, v1, s: one(q1, k1, v1, None, s)  # noqa: E731
            return jax.vmap(rows, in_axes=(0, 0, 0, None))(q, k, v, sinks)
        return jax.vmap(one, in_axes=(0, 0, 0, 0, None))(q, k, v, seg, sinks)

    return _named_residuals(attend)(q, k, v, seg, sinks)


def _named_residuals(attend):
    """``attend`` with its backward residuals (but its inputs) named ``SPLASH_RESIDUALS``.

    The kernel names its own residuals inside a nested ``jit``, where a remat policy does not
    reach them; named here, a policy that saves them (with ``attn_out``) skips the forward
    kernel when the backward pass recomputes the layer.
    """

    @jax.custom_vjp
    def run(q, k, v, seg, sinks):
        return attend(q, k, v, seg, sinks)

    def forward(q, k, v, seg, sinks):
        out, backward = jax.vjp(lambda q, k, v, s: attend(q, k, v, seg, s), q, k, v, sinks)
        inputs = (q, k, v, seg, sinks)  # left unnamed: saved or recomputed as the layer's own

        def name(x):
            return x if any(x is a for a in inputs) else checkpoint_name(x, SPLASH_RESIDUALS)

        return out, jax.tree.map(name, backward)

    def backward(residuals, g):
        dq, dk, dv, dsinks = residuals(g)
        return dq, dk, dv, None, dsinks

    run.defvjp(forward, backward)
    return run


def _kernel(
    heads: int,
    q_len: int,
    kv_len: int,
    block_q: int,
    block_kv: int,
    interpret: bool,
    window: int | None = None,
):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if window is None:
        one = sa.CausalMask((q_len, kv_len))
    else:  # causal, and at most window - 1 keys back
        one = sa.LocalMask((q_len, kv_len), window_size=(window - 1, 0), offset=0)
    mask = sa.MultiHeadMask([one for _ in range(heads)])
    sizes = sa.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )
    # built in each trace (its mask tables become that trace's constants); JAX caches the
    # mask processing itself
    return sa.make_splash_mha(
        mask,
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )


def _mesh_axes(mesh, batch: int, kv_heads: int, heads: int):
    """Mesh axes for the batch and head dimensions: those of the compute mapping where the
    sizes divide, else None (that dimension whole on every device)."""
    return mapped_axes(mesh, "batch", batch), mapped_axes(mesh, Heads, heads, kv_heads)


_PASSES = {"fwd": 4, "dq": 6, "dkv": 8, "bwd": 10}
"""Matmul FLOPs per visible (query, key) pair and head dimension of each splash kernel:
forward QK^T and PV; dq recomputes QK^T, then dO V^T and dS K; dkv recomputes QK^T,
then dO V^T, P^T dO and dS^T Q; the fused backward does both (QK^T and dO V^T once)."""


def splash_kernel_flops(
    name: str, q_shape: tuple[int, ...], kv_len: int, *, causal: bool = True
) -> float | None:
    """Matmul FLOPs of one call of a splash kernel (``name`` as the Pallas call names it,
    ``q_shape`` ``[..., heads, T, D]``), counting only the visible (causal) pairs, or every
    pair where not ``causal`` (the ring's all-visible chunk pairs); None for a kernel that
    is not splash's."""
    if not name.startswith("splash_"):
        return None
    parts = name.split("_")
    passes = next((_PASSES[p] for p in parts if p in _PASSES), None)
    if passes is None:
        return None
    *lead, q_len, head_dim = q_shape
    short = min(q_len, kv_len)  # query i sees keys 0..i
    visible = short * (short + 1) / 2 + (q_len - short) * kv_len if causal else q_len * kv_len
    return float(passes * math.prod(lead) * visible * head_dim)
