"""The ``xla``/``cudnn`` backends (``jax_attention``), and document-masked attention through
cuDNN's packed-sequence kernels (NVIDIA GPUs).

``jax.nn.dot_product_attention`` takes a document mask only as a dense ``[B, 1, T, T]``
bias, which cuDNN reads for every head and tile. cuDNN can instead attend within packed
segments given their lengths and offsets (JAX's ``q_seqlen``/``q_offsets``, the "THD"
layout), skipping every tile across a document boundary. Those tensors have a static
number of documents per row, ``max_docs`` (``model.cudnn_packed_documents``): a batch in
which some row holds more runs the dense-mask kernel instead (``lax.cond``), so the result
never depends on the limit. A document is a run of equal segment ids; ids that come back
after another document (``A B A``) are separate documents here, as in every packed batch
``segment_ids_from_eos`` makes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def document_runs(seg: jax.Array, max_docs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(lengths [B, max_docs], offsets [B, max_docs + 1], runs [B])`` of the runs of equal
    ids in each row of ``seg [B, T]``, in the form JAX's cuDNN packed layout takes: each run's
    length and start, -1 past a row's runs (the offsets' last column is always -1: JAX
    compacts the non-negative entries of all rows, so an end marker would shift the next
    row's segments against their lengths). ``runs`` is the
    number of runs per row; where it exceeds ``max_docs`` the first two describe only the
    first ``max_docs`` runs (``cudnn_document_attention`` then uses the dense mask)."""
    new_run = jnp.concatenate(
        [jnp.ones_like(seg[:, :1], jnp.int32), (seg[:, 1:] != seg[:, :-1]).astype(jnp.int32)],
        axis=1,
    )
    run = jnp.cumsum(new_run, axis=1) - 1  # [B, T]: index of each position's run
    runs = run[:, -1] + 1
    j = jnp.arange(max_docs + 1, dtype=jnp.int32)
    starts = jnp.sum(run[:, None, :] < j[None, :, None], axis=-1, dtype=jnp.int32)
    lengths = jnp.where(j[None, :-1] < runs[:, None], starts[:, 1:] - starts[:, :-1], -1)
    offsets = jnp.where(j[None, :] < runs[:, None], starts, -1)
    return lengths.astype(jnp.int32), offsets.astype(jnp.int32), runs


def cudnn_document_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, max_docs: int
) -> jax.Array:
    """Causal attention within documents, ``q [B, T, N, D]``, ``k, v [B, T, K, D]`` (bf16 or
    fp16, K dividing N): cuDNN's packed kernel when every row has at most ``max_docs``
    documents, else cuDNN with the dense mask."""
    # private: jax.nn.dot_product_attention takes no q_offsets/kv_offsets (packed documents)
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_sdpa

    lengths, offsets, runs = document_runs(seg, max_docs)
    scale = 1 / math.sqrt(q.shape[-1])

    def packed(q, k, v):
        return cudnn_sdpa(
            q,
            k,
            v,
            q_seqlen=lengths,
            kv_seqlen=lengths,
            q_offsets=offsets,
            kv_offsets=offsets,
            scale=scale,
            mask_type=MaskType.PADDING_CAUSAL,
            qkv_layout="BTNH",
        )

    def dense(q, k, v):
        mask = (seg[:, :, None] == seg[:, None, :])[:, None]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation="cudnn"
        )

    return jax.lax.cond(jnp.max(runs) <= max_docs, packed, dense, q, k, v)


def jax_attention(q, k, v, seg, implementation, cudnn_documents=0, window=None, scale=None):
    """The ``xla`` and ``cudnn`` backends: ``jax.nn.dot_product_attention`` of ``q [B, K, G, T,
    D]`` over ``k``/``v [B, K, T, D]`` (document ids ``seg [B, T]`` or None), through cuDNN's
    packed-sequence kernel where ``cudnn_documents`` allows (``cudnn_document_attention``)."""
    B, K, G, T, D = q.shape
    qj = q.reshape(B, K * G, T, D).transpose(0, 2, 1, 3)  # [B, T, N, D], heads kv-major
    kj, vj = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    default_scale = scale is None or scale == 1 / math.sqrt(D)
    packed = seg is not None and cudnn_documents > 0 and window is None and default_scale
    if implementation == "cudnn" and packed:
        out = cudnn_document_attention(qj, kj, vj, seg, cudnn_documents)
    else:
        mask = None
        if seg is not None:
            mask = (seg[:, :, None] == seg[:, None, :])[:, None]  # [B, 1, T, S]
        out = jax.nn.dot_product_attention(
            qj, kj, vj, mask=mask, is_causal=True, implementation=implementation, scale=scale,
            local_window_size=None if window is None else (window - 1, 0),
        )  # fmt: skip
    return out.transpose(0, 2, 1, 3).reshape(B, K, G, T, D)
