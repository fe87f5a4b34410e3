"""FP8 matmuls with current (per-tensor, just-in-time) scaling for the linear layers.

``model.fp8`` turns every ``haliax.nn.Linear`` inside the transformer blocks into an FP8
matmul (``to_fp8``); the embeddings, the LM head, the MoE experts and router, and attention's
score matmuls stay in the compute dtype (as torchtitan and Transformer Engine recipes do).

Each matmul quantises its two operands to **e4m3** (max 448) with a per-tensor scale taken
from that tensor's own absolute maximum in the same step (current scaling: no amax
history, so no state to keep or checkpoint, and no stale scale after a spike), multiplies
them with float32 accumulation and rescales. In the backward pass the incoming gradient is
quantised to **e5m2** (max 57,344, more range) the same way, and both gradient matmuls use
it against the saved e4m3 operands. Only the FP8 operands and their scales are saved for the
backward pass, not the compute-dtype inputs.

All three matmuls of a linear layer (forward ``x·w``, dgrad ``dy·wᵀ``, wgrad ``xᵀ·dy``)
are a ``dot_general`` of the FP8 arrays themselves with float32 accumulation
(``scaled_dot``), then times the product of the two float32 scales; the backward applies
JAX's transpose rule for ``dot_general`` to the FP8 cotangent and the saved FP8 operand. No
operand is converted back to a wider type before its dot. Compiled for an H100 (compile-only,
tests/models/blocks/test_fp8.py), each is one FP8 GEMM: a Triton GEMM fusion of the FP8 operands by
XLA's default, a cuBLASLt FP8 call (``__cublas$lt$matmul$f8``) with Triton GEMMs off; XLA's
dot merger may join the matmuls that share an FP8 operand (q, k, v; gate, up) into one. The
dequantise-then-dot form this replaced (``convert(f8) * scale`` into the dot) compiled, by
XLA's default, to bf16/f32 Triton GEMMs with the quantisation folded away (only with Triton
GEMMs off did the GEMM rewriter make cuBLASLt FP8 calls of it). Elsewhere (CPU)
XLA widens the FP8 operands itself: the same numbers, without the speed. ``model.fp8: on``
is refused on devices without FP8 matmuls; ``emulate`` runs the same arithmetic anywhere
(numerics, tests).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import equinox as eqx
import haliax.nn as hnn
import jax
import jax.numpy as jnp

from loomax.config import ConfigError

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
MODES = ("off", "on", "emulate")
MIN_COMPUTE_CAPABILITY = 8.9
"""NVIDIA GPUs with FP8 tensor cores: Ada (8.9) and Hopper (9.0) on."""


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)`` with ``q = clip(x / scale)`` in ``dtype`` and ``scale = amax / max``
    (float32; 1 for an all-zero tensor), so that ``q * scale`` approximates ``x``."""
    top = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    scaled = (x.astype(jnp.float32) / scale).clip(-top, top)
    return scaled.astype(dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    return q.astype(dtype) * scale.astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, out_dtype) -> jax.Array:
    """``dot_general(lhs, rhs)`` through e4m3 operands, e5m2 gradients (module docstring)."""
    return _fwd(lhs, rhs, dimension_numbers, out_dtype)[0]


def scaled_dot(qa, sa, qb, sb, dimension_numbers, out_dtype) -> jax.Array:
    """``dot_general`` of the FP8 arrays themselves (float32 accumulation), then times the
    product of their float32 scales: the FP8 GEMM with its scales."""
    out = jax.lax.dot_general(qa, qb, dimension_numbers, preferred_element_type=jnp.float32)
    return (out * (sa * sb)).astype(out_dtype)


def _remaining(ndim: int, *removed) -> list[int]:
    gone = {i for dims in removed for i in dims}
    return [i for i in range(ndim) if i not in gone]


def _argsort(values) -> list[int]:
    return sorted(range(len(values)), key=list(values).__getitem__)


def _cotangent(qg, sg, qy, sy, x_ndim, dimension_numbers, out_dtype, swap_ans=False):
    """The cotangent of ``x`` in ``dot_general(x, y)``: one ``dot_general(g, y)`` of the
    quantised cotangent and the saved quantised ``y``, transposed into ``x``'s axes (JAX's
    transpose rule for ``dot_general``, on FP8 operands). ``swap_ans``: ``x`` was the right
    operand, so ``y``'s kept axes come first in the cotangent."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(qy.ndim, y_contract, y_batch)
    first = len(x_batch) + (0 if swap_ans else len(x_kept))
    g_y = list(range(first, first + len(y_kept)))  # the cotangent's axes from y
    dims = ((g_y, y_kept), (list(range(len(x_batch))), list(y_batch)))
    x_contract_by_y = [x_contract[i] for i in _argsort(y_contract)]
    out_axes = tuple(_argsort([*x_batch, *x_kept, *x_contract_by_y]))
    return jnp.transpose(scaled_dot(qg, sg, qy, sy, dims, out_dtype), out_axes)


def _fwd(lhs, rhs, dimension_numbers, out_dtype):
    ql, sl = quantize(lhs, E4M3)
    qr, sr = quantize(rhs, E4M3)
    out = scaled_dot(ql, sl, qr, sr, dimension_numbers, out_dtype)
    return out, (ql, sl, qr, sr, lhs.dtype, rhs.dtype)


def _fwd_rule(lhs, rhs, dimension_numbers, out_dtype):
    out, res = _fwd(lhs, rhs, dimension_numbers, out_dtype)
    ql, sl, qr, sr, ldt, rdt = res
    return out, (ql, sl, qr, sr, jnp.zeros((), ldt), jnp.zeros((), rdt))


def _bwd_rule(dimension_numbers, out_dtype, res, g):
    ql, sl, qr, sr, lzero, rzero = res
    qg, sg = quantize(g, E5M2)
    (lc, rc), (lb, rb) = dimension_numbers
    dl = _cotangent(qg, sg, qr, sr, ql.ndim, dimension_numbers, lzero.dtype)  # dgrad
    swapped = ((rc, lc), (rb, lb))
    dr = _cotangent(qg, sg, ql, sl, qr.ndim, swapped, rzero.dtype, swap_ans=True)  # wgrad
    return dl, dr


fp8_dot_general.defvjp(_fwd_rule, _bwd_rule)


class Fp8DotGeneral(eqx.Module):
    """A ``haliax.nn.Linear`` ``dot_general`` that multiplies in FP8 (current scaling)."""

    def __call__(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None
    ) -> jax.Array:
        out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
        return fp8_dot_general(lhs, rhs, dimension_numbers, jnp.dtype(out_dtype))


def to_fp8(model: Any) -> Any:
    """``model`` with the ``Linear`` layers of its transformer blocks (``model.blocks``)
    multiplying in FP8; MoE routers (``router``) and everything outside the blocks unchanged."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ConfigError(f"model.fp8: {type(model).__name__} has no transformer blocks")

    def convert(path, node):
        if isinstance(node, hnn.Linear) and "router" not in jax.tree_util.keystr(path):
            return eqx.tree_at(lambda lin: lin.dot_general, node, Fp8DotGeneral())
        return node

    is_linear = lambda x: isinstance(x, hnn.Linear)  # noqa: E731
    new_blocks = jax.tree_util.tree_map_with_path(convert, blocks, is_leaf=is_linear)
    return eqx.tree_at(lambda m: m.blocks, model, new_blocks)


def fp8_supported(devices: list[Any] | None = None) -> tuple[bool, str]:
    """Whether every device multiplies FP8 natively, and what they are (for the error)."""
    devices = devices if devices is not None else jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    for d in devices:
        if d.platform != "gpu":
            return False, f"{d.platform} devices ({', '.join(kinds)})"
        capability = float(getattr(d, "compute_capability", "0") or 0)
        if capability < MIN_COMPUTE_CAPABILITY:
            return False, f"GPUs of compute capability {capability} ({', '.join(kinds)})"
    return True, ", ".join(kinds)


def check_fp8(mode: str, devices: list[Any] | None = None) -> None:
    """Refuse ``model.fp8: on`` where the devices lack FP8 matmuls (before any work)."""
    if mode != "on":
        return
    ok, what = fp8_supported(devices)
    if not ok:
        raise ConfigError(
            f"model.fp8: on needs FP8 matmuls (NVIDIA compute capability "
            f"{MIN_COMPUTE_CAPABILITY}+: Ada, Hopper, Blackwell); this run has {what}. "
            "Use model.fp8: emulate for the same arithmetic without the speed, or off"
        )
