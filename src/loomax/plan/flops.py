"""Matmul FLOPs of a traced step, counting every iteration of its loops, and its kernels.

XLA's cost analysis counts the body of a loop once, so a scanned stack of layers (and a
microbatch loop) looks ``num_layers`` times cheaper to it than it is; and it counts a
Pallas/Mosaic kernel (a custom call) as almost free. Walking the step's jaxpr instead, each
``dot_general`` counts ``2 x output size x contracted size`` times the length of every
``scan`` around it (and the devices of a ``shard_map`` around it); the backward pass and
rematerialized forward passes are in the jaxpr, so they are counted too. Each Pallas call
is counted apart (``KernelCall``): its FLOPs from its math (splash attention: the visible
causal pairs, ``splash_kernel_flops``; a grouped matmul whose grid is sized at run time,
megablox: ``2 x lhs size x n``; another kernel: its body's matmuls once per grid step) and
the bytes of its operands and results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
from jax.extend import core as jex_core

from loomax.models.splash import splash_kernel_flops


@dataclass
class KernelCall:
    """One Pallas kernel of the step: FLOPs and bytes of one call, and how many calls."""

    name: str
    flops: float
    bytes: float
    calls: float = 1.0


@dataclass
class StepCount:
    """What a step executes: XLA's matmul FLOPs and the Pallas kernels, all devices."""

    dot_flops: float = 0.0
    kernels: dict[str, KernelCall] = field(default_factory=dict)

    @property
    def kernel_flops(self) -> float:
        return sum(k.flops * k.calls for k in self.kernels.values())

    @property
    def total_flops(self) -> float:
        return self.dot_flops + self.kernel_flops

    def add(self, other: StepCount, times: float = 1.0) -> None:
        self.dot_flops += other.dot_flops * times
        for key, k in other.kernels.items():
            mine = self.kernels.setdefault(key, KernelCall(k.name, k.flops, k.bytes, 0.0))
            mine.calls += k.calls * times


def count_step(jaxpr: Any) -> StepCount:
    """Global matmul FLOPs and kernel calls of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    count = StepCount()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            count.dot_flops += _dot(eqn)
        elif name == "pallas_call":
            kernel = _kernel(eqn)
            count.add(StepCount(kernels={_kernel_key(eqn, kernel): kernel}))
        elif name == "cond":
            branches = [count_step(b) for b in eqn.params["branches"]]
            count.add(max(branches, key=lambda c: c.total_flops, default=StepCount()))
        else:
            times = 1.0
            if name == "scan":
                times = eqn.params["length"]
            elif name == "shard_map":  # the body's shapes are one device's
                times = eqn.params["mesh"].size
            for sub in _subjaxprs(eqn.params):
                count.add(count_step(sub), times)
    return count


def _dot(eqn) -> float:
    (contract_lhs, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    contracted = math.prod(lhs_shape[d] for d in contract_lhs)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


def _kernel(eqn) -> KernelCall:
    name = str(eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", ""))
    arrays = [v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "shape")]
    nbytes = float(sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays))
    flops = None
    float_ins = [
        a
        for a in arrays[: len(eqn.invars)]
        if jnp.issubdtype(a.dtype, jnp.floating) and a.ndim >= 3
    ]
    if len(float_ins) >= 2:  # splash: q [..., heads, T, D], then k [..., S, D]
        flops = splash_kernel_flops(name, float_ins[0].shape, float_ins[1].shape[-2])
    grid = getattr(eqn.params.get("grid_mapping"), "grid", ())
    matrices = [a for a in arrays[: len(eqn.invars)] if jnp.issubdtype(a.dtype, jnp.floating)]
    if flops is None and not all(isinstance(g, int) for g in grid) and len(matrices) >= 2:
        # a grid sized at run time (megablox gmm / tgmm: the row tiles its groups cover):
        # a grouped matmul, every row of lhs [m, k] (or [k, m]) times rhs's n columns once
        flops = 2.0 * math.prod(matrices[0].shape) * matrices[1].shape[-1]
    if flops is None:  # another kernel: its body's matmuls once per grid step
        body = eqn.params.get("jaxpr")
        steps = math.prod(g for g in grid if isinstance(g, int))
        flops = count_step(body).total_flops * steps if body is not None else 0.0
    return KernelCall(name or "pallas_call", flops, nbytes)


def _kernel_key(eqn, kernel: KernelCall) -> str:
    shapes = ",".join(str(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape"))
    return f"{kernel.name}[{shapes}]"


def _subjaxprs(params: dict) -> list:
    found = []
    for key, value in params.items():
        if key == "branches":
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, jex_core.ClosedJaxpr | jex_core.Jaxpr):
                found.append(item)
    return found
