"""Matmul FLOPs of a traced step, counting every iteration of its loops, and its kernels.

XLA's cost analysis counts the body of a loop once, so a scanned stack of layers (and a
microbatch loop) looks ``num_layers`` times cheaper to it than it is; and it counts a
Pallas/Mosaic kernel (a custom call) as almost free. Walking the step's jaxpr instead, each
``dot_general`` counts ``2 x output size x contracted size`` times the length of every
``scan`` around it (and the devices of a ``shard_map`` around it); the backward pass and
rematerialized forward passes are in the jaxpr, so they are counted too. Each Pallas call
is counted apart (``KernelCall``): its FLOPs from its math (splash attention: the visible
causal pairs, ``splash_kernel_flops``, every pair under the splash ring's all-visible scope,
``models/attention/splash_pair.py``; a grouped matmul whose grid is sized at run time,
megablox: ``2 x lhs size x n``, n the result's columns; another kernel: its body's matmuls once per grid step) and
the bytes of its operands and results. A grouped matmul on a buffer only partly filled
(expert parallelism's receive buffer) runs under a ``routed_rows=R/M`` name scope
(``models/moe/grouped_matmul.py``): a kernel whose grid follows the groups is charged for the
R routed rows of its M, FLOPs and row bytes alike; the blocked form's loop over its occupied
tiles (a ``while``, sized at run time) counts its body times the trips its ``loop_trips=N``
scope expects for the routed rows. ``ragged_dot_general`` counts as
what XLA executes for it on CPU and GPU (JAX 0.10; the compiled H100 HLO shows it): the
dense product over every group, G times the routed work. Of a ``cond``, the costlier branch
counts, except a rare fallback (the MoE backward's recompute when a device holds more routed
rows than it kept, ``models/moe/expert_ffn.py``): the count assumes the routed rows fit, and says
how many such fallbacks it left out (``StepCount.fallbacks``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
from jax.extend import core as jex_core

from loomax.models.attention.splash import splash_kernel_flops
from loomax.models.attention.splash_pair import FULL_SCOPE
from loomax.models.moe.expert_ffn import KEPT_ROWS_FALLBACK
from loomax.models.moe.grouped_matmul import LOOP_TRIPS, ROUTED_ROWS

_ROUTED = re.compile(ROUTED_ROWS + r"=(\d+)/(\d+)")
_TRIPS = re.compile(LOOP_TRIPS + r"=(\d+)")


@dataclass
class KernelCall:
    """One Pallas kernel of the step: FLOPs and bytes of one call, and how many calls."""

    name: str
    flops: float
    bytes: float
    calls: float = 1.0
    routed: float = 1.0
    """The share of its rows that are routed (``routed_rows=R/M`` scope); 1.0 outside one.
    The estimate's load-imbalance term scales such a kernel's time (``plan/estimate.py``)."""


@dataclass
class StepCount:
    """What a step executes: XLA's matmul FLOPs and the Pallas kernels, all devices."""

    dot_flops: float = 0.0
    kernels: dict[str, KernelCall] = field(default_factory=dict)
    fallbacks: float = 0.0
    """Conditionals whose rare fallback branch (``KEPT_ROWS_FALLBACK``) was left out."""

    @property
    def kernel_flops(self) -> float:
        return sum(k.flops * k.calls for k in self.kernels.values())

    @property
    def total_flops(self) -> float:
        return self.dot_flops + self.kernel_flops

    def add(self, other: StepCount, times: float = 1.0) -> None:
        self.dot_flops += other.dot_flops * times
        self.fallbacks += other.fallbacks * times
        for key, k in other.kernels.items():
            mine = self.kernels.setdefault(key, KernelCall(k.name, k.flops, k.bytes, 0.0, k.routed))
            mine.calls += k.calls * times


def count_step(jaxpr: Any, scope: str = "", *, with_fallbacks: bool = False) -> StepCount:
    """Global matmul FLOPs and kernel calls of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``);
    ``scope`` is the name stack around it (each equation's own is relative to it).
    ``with_fallbacks``: count rare fallback branches too, as if always taken."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    count = StepCount()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        where = f"{scope}/{eqn.source_info.name_stack}"
        if name == "dot_general":
            count.dot_flops += _dot(eqn)
        elif name == "ragged_dot_general":
            count.dot_flops += _ragged_dot(eqn)
        elif name == "pallas_call":
            kernel = _kernel(eqn, where)
            count.add(StepCount(kernels={_kernel_key(eqn, kernel): kernel}))
        elif name == "cond":  # the costlier branch, unless it is a rare fallback
            branches = [
                count_step(b, where, with_fallbacks=with_fallbacks) for b in eqn.params["branches"]
            ]
            pairs = zip(eqn.params["branches"], branches, strict=True)
            usual = [c for b, c in pairs if not _fallback(b)]
            if len(usual) < len(branches) and usual:
                count.fallbacks += 1
                branches = branches if with_fallbacks else usual
            count.add(max(branches, key=lambda c: c.total_flops, default=StepCount()))
        else:
            times = 1.0
            if name == "scan":
                times = eqn.params["length"]
            elif name == "while":  # a loop sized at run time: its expected trips, if named
                times = loop_trips(where)
            elif name == "shard_map":  # the body's shapes are one device's along its manual axes
                mesh = eqn.params["mesh"]
                manual = eqn.params.get("newly_manual_axes") or mesh.axis_names
                times = math.prod(mesh.shape[a] for a in manual)
            for sub in _subjaxprs(eqn.params):
                count.add(count_step(sub, where, with_fallbacks=with_fallbacks), times)
    return count


def _fallback(branch: Any) -> bool:
    """Whether a cond branch is a rare fallback: its work runs under ``KEPT_ROWS_FALLBACK``
    (the MoE backward's recompute on a device holding more rows than it kept)."""
    jaxpr = getattr(branch, "jaxpr", branch)
    return any(KEPT_ROWS_FALLBACK in str(e.source_info.name_stack) for e in jaxpr.eqns)


def loop_trips(scope: str) -> float:
    """The expected trips of a loop whose count is known only at run time, from the innermost
    ``loop_trips`` scope in ``scope`` (the blocked grouped matmul's occupied tiles); 1 without
    one."""
    found = _TRIPS.findall(scope)
    return float(found[-1]) if found else 1.0


def routed_fraction(scope: str) -> float:
    """The share of a buffer's rows that are routed, from the innermost ``routed_rows``
    scope in ``scope`` (1.0 without one)."""
    found = _ROUTED.findall(scope)
    if not found:
        return 1.0
    rows, of = (int(x) for x in found[-1])
    return min(1.0, rows / of) if of else 1.0


def _dot(eqn) -> float:
    (contract_lhs, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    contracted = math.prod(lhs_shape[d] for d in contract_lhs)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


def _ragged_dot(eqn) -> float:
    """The dense product XLA executes for a ragged dot: every group's weights times every
    row (``2 x output size x contracted size``, times G when the output has no group axis)."""
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (contract_lhs, _), _ = numbers.dot_dimension_numbers
    lhs_shape = eqn.invars[0].aval.shape
    contracted = math.prod(lhs_shape[d] for d in contract_lhs)
    groups = eqn.invars[2].aval.shape[-1] if numbers.rhs_group_dimensions else 1
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted * groups


def _kernel(eqn, scope: str = "") -> KernelCall:
    name = str(eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", ""))
    arrays = [v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "shape")]
    nbytes = float(sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays))
    flops, share = None, 1.0
    float_ins = [
        a
        for a in arrays[: len(eqn.invars)]
        if jnp.issubdtype(a.dtype, jnp.floating) and a.ndim >= 3
    ]
    if len(float_ins) >= 2:  # splash: q [..., heads, T, D], then k [..., S, D]
        full = FULL_SCOPE in scope  # the splash ring's all-visible chunk pairs
        flops = splash_kernel_flops(
            name, float_ins[0].shape, float_ins[1].shape[-2], causal=not full
        )
    grid = getattr(eqn.params.get("grid_mapping"), "grid", ())
    matrices = [a for a in arrays[: len(eqn.invars)] if jnp.issubdtype(a.dtype, jnp.floating)]
    if flops is None and not all(isinstance(g, int) for g in grid) and len(matrices) >= 2:
        # a grid sized at run time (megablox gmm / tgmm: the row tiles its groups cover):
        # a grouped matmul, every routed row of lhs [m, k] (or [k, m]) times the n columns of
        # the result ([m, n] from gmm, rhs transposed or not; [G, k, n] from tgmm)
        share = routed_fraction(scope)
        flops = 2.0 * math.prod(matrices[0].shape) * eqn.outvars[0].aval.shape[-1] * share
        rows = sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays if a.ndim == 2)
        nbytes -= (1.0 - share) * rows  # the 2-D operands are rows; [G, k, n] are weights
    if flops is None:  # another kernel: its body's matmuls once per grid step
        body = eqn.params.get("jaxpr")
        steps = math.prod(g for g in grid if isinstance(g, int))
        flops = count_step(body).total_flops * steps if body is not None else 0.0
    return KernelCall(name or "pallas_call", flops, nbytes, routed=share)


def _kernel_key(eqn, kernel: KernelCall) -> str:
    shapes = ",".join(str(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape"))
    return f"{kernel.name}[{shapes}]:{kernel.flops:.6g}"  # same shapes, other routed rows


def _subjaxprs(params: dict) -> list:
    found = []
    for key, value in params.items():
        if key == "branches":
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, jex_core.ClosedJaxpr | jex_core.Jaxpr):
                found.append(item)
    return found
