"""Matmul FLOPs of a traced step, counting every iteration of its loops.

XLA's cost analysis counts the body of a loop once, so a scanned stack of layers (and a
microbatch loop) looks ``num_layers`` times cheaper to it than it is. Walking the step's
jaxpr instead, each ``dot_general`` counts ``2 x output size x contracted size`` times the
length of every ``scan`` around it; the backward pass and rematerialized forward passes
are in the jaxpr, so they are counted too.
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core as jex_core


def dot_flops(jaxpr: Any) -> float:
    """Global matmul FLOPs of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), loops unrolled."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot(eqn)
            continue
        inner = sum(dot_flops(sub) for sub in _subjaxprs(eqn.params))
        if name == "scan":
            inner *= eqn.params["length"]
        elif name == "cond":
            branches = [dot_flops(b) for b in eqn.params["branches"]]
            inner = max(branches, default=0.0)
        total += inner
    return total


def _dot(eqn) -> float:
    (contract_lhs, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    contracted = math.prod(lhs_shape[d] for d in contract_lhs)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


def _subjaxprs(params: dict) -> list:
    found = []
    for key, value in params.items():
        if key == "branches":
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, jex_core.ClosedJaxpr | jex_core.Jaxpr):
                found.append(item)
    return found
