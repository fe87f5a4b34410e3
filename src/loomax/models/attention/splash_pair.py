"""One chunk pair of the ring through JAX's Pallas splash kernels (the ring's TPU kernel).

A ``SplashPair`` is a query chunk over a key chunk of the same length, all visible (document
ids only) or causal (a chunk over itself). ``forward`` returns the pair's output and
log-sum-exp (splash's ``save_residuals``); ``backward`` takes the *global* log-sum-exp and
``D = rowsum(dO * O)`` of the whole ring and returns this pair's share of dQ/dK/dV, through
splash's backward kernels ``_splash_attention_bwd_dq`` / ``_splash_attention_bwd_dkv``.
JAX keeps those private: ``private_kernels`` checks their parameters against the ones read
in JAX ``PINNED_JAX`` and raises naming both versions where they differ.

Queries come pre-scaled (splash does not scale), ``[b, heads, c, D]`` kv-major; keys and
values ``[b, kv_heads, c, D]``; document ids ``[b, c]``. Off TPU the kernels run in Pallas's
interpret mode (tests). Each call runs under ``jax.named_scope(scope)`` (``FULL_SCOPE`` or
``CAUSAL_SCOPE``): the plan's FLOP count (``plan/flops.py``) reads it to charge an all-visible
pair its whole square.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property

import jax

PINNED_JAX = "0.10.2"
"""The JAX version whose private splash backward entry points this module was written against."""
FULL_SCOPE = "ring_splash_full"
"""Name scope of the all-visible pairs' kernels (every query sees every key of its document)."""
CAUSAL_SCOPE = "ring_splash_causal"
"""Name scope of the causal diagonals' kernels."""

_COMMON = ("q", "k", "v", "segment_ids", "sinks", "logsumexp", "do", "di", "bq", "bkv")
_LAYOUT = ("q_layout", "k_layout", "v_layout", "mask_function", "interpret")
_PARAMS = {
    "_splash_attention_bwd_dq": (
        *_COMMON, "is_mqa", "mask_info", "mask_value", "attn_logits_soft_cap", *_LAYOUT
    ),
    "_splash_attention_bwd_dkv": (
        *_COMMON, "bkv_compute", "is_mqa", "mask_info", "mask_value", "attn_logits_soft_cap",
        "use_fused_bwd_kernel", *_LAYOUT,
    ),
}  # fmt: skip
"""The private backward entry points and their parameters in JAX ``PINNED_JAX``."""


def private_kernels():
    """JAX's splash kernel module, once its private backward entry points are checked to take
    the parameters this module passes; else ``RuntimeError`` naming the JAX versions."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    for name, expected in _PARAMS.items():
        fn = getattr(sk, name, None)
        got = None if fn is None else tuple(inspect.signature(fn).parameters)
        if got != expected:
            raise RuntimeError(
                f"the splash ring kernel needs JAX's private splash_attention_kernel.{name} "
                f"with parameters {expected} (as in JAX {PINNED_JAX}); JAX {jax.__version__} "
                f"has {got if got is not None else 'no such function'}. Use model.attn_backend "
                "blockwise with context parallelism, or adapt models/attention/splash_pair.py"
            )
    return sk


def _collapsed(info):
    """``info`` with its partial mask blocks as one ``[n, bq, bkv]`` stack (as splash's own
    ``_splash_attention`` passes them to its kernels)."""
    if info is None or info.partial_mask_blocks is None:
        return info
    blocks = info.partial_mask_blocks
    return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


@dataclass(frozen=True)
class SplashPair:
    """The splash kernels of one chunk pair shape: ``heads`` query heads, chunks of ``length``
    positions, blocks of ``block_q`` x ``block_kv``; ``causal`` for a chunk over itself."""

    heads: int
    length: int
    block_q: int
    block_kv: int
    causal: bool
    interpret: bool

    @property
    def scope(self) -> str:
        return CAUSAL_SCOPE if self.causal else FULL_SCOPE

    @cached_property
    def kernel(self):
        from jax.experimental.pallas.ops.tpu import splash_attention as sa

        shape = (self.length, self.length)
        one = sa.CausalMask(shape) if self.causal else sa.FullMask(shape)
        bq, bkv = self.block_q, self.block_kv
        sizes = sa.BlockSizes(
            block_q=bq, block_kv=bkv, block_kv_compute=bkv,
            block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
            block_q_dq=bq, block_kv_dq=bkv,
        )  # fmt: skip
        return sa.make_splash_mha(
            sa.MultiHeadMask([one] * self.heads),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            save_residuals=True,
            interpret=self.interpret,
        )

    def forward(self, q, k, v, q_seg, k_seg) -> tuple[jax.Array, jax.Array]:
        """This pair's output ``[b, heads, c, D]`` (``q``'s dtype) and log-sum-exp
        ``[b, heads, c]`` (float32; about -2.4e38 for a query that sees no key here)."""
        from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

        kernel = self.kernel

        def one(q, k, v, qs, ks):
            out, (lse,) = kernel(q, k, v, segment_ids=SegmentIds(qs, ks))
            return out, lse

        with jax.named_scope(self.scope):
            return jax.vmap(one)(q, k, v, q_seg, k_seg)

    def backward(self, q, k, v, q_seg, k_seg, lse, do, di):
        """This pair's ``(dq, dk, dv)`` (dq of the scaled queries) given the whole ring's
        log-sum-exp ``lse`` and ``di = rowsum(dO * O)`` (``[b, heads, c]``, float32) and
        ``do`` (``q``'s layout and dtype)."""
        from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

        sk, kernel = private_kernels(), self.kernel
        sizes, mask_function = kernel.kwargs["block_sizes"], kernel.kwargs["mask_function"]
        shared = dict(
            is_mqa=False,
            mask_value=kernel.kwargs["mask_value"],
            attn_logits_soft_cap=None,
            q_layout=sizes.q_layout,
            k_layout=sizes.k_layout,
            v_layout=sizes.v_layout,
            mask_function=mask_function,
            interpret=self.interpret,
        )
        dq_info, dkv_info = _collapsed(kernel.dq_mask_info), _collapsed(kernel.dkv_mask_info)

        def one(q, k, v, qs, ks, lse, do, di):
            seg = SegmentIds(qs, ks)
            args = (q, k, v, seg, None, lse, do, di)
            dq = sk._splash_attention_bwd_dq(
                *args, bq=sizes.block_q_dq, bkv=sizes.block_kv_dq, mask_info=dq_info, **shared
            )
            _, dk, dv = sk._splash_attention_bwd_dkv(
                *args,
                bq=sizes.block_q_dkv,
                bkv=sizes.block_kv_dkv,
                bkv_compute=sizes.block_kv_dkv_compute,
                mask_info=dkv_info,
                use_fused_bwd_kernel=False,
                **shared,
            )
            return dq, dk, dv

        with jax.named_scope(self.scope):
            return jax.vmap(one)(q, k, v, q_seg, k_seg, lse, do, di)
