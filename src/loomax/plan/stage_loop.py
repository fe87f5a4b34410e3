"""The staged loop of a traced train step, and the bubble its count implies (estimates).

A staged step (``trainer.mesh.stage`` > 1) runs its layer stack in a ``jax.lax.scan`` over
time slots inside a ``shard_map`` manual over ``stage`` (``models/blocks/pipeline.py``,
``pipeline_explicit.py``). ``loomax plan`` counts each loop's body once per slot
(``plan/flops.py``), so the bubble is in its FLOPs and its estimate. This module reads, off
the traced program, the loop's slots (its length) and, for the loop of the loss-in-loop
schedules, each branch of its per-slot ``switch``, and states the bubble four ways:

- ``formula``: the schedule's textbook figure (``pipeline_schedules.formula``);
- ``slots``: the idle share of the compiled loop's slots, ``1 - busy / slots`` (busy: the
  slots a stage works in: ``v m`` for GPipe, ``2 v m`` for 1F1B, ``3 m`` for zero-bubble);
- ``counted``: the share of the counted FLOPs no stage needed: GPipe's idle slots compute on
  zeros (the same as ``slots``); the explicit loop's ``switch`` is counted at its costliest
  branch every slot (``flops.count_step``), against each stage's own branch per the table;
- ``lockstep``: the explicit loop with every slot as long as its busiest stage's branch
  (slots end in a ``ppermute``), the work in FLOPs: between ``slots`` and ``counted``.

All four are estimates from counts of the program, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from loomax.pipeline_schedules import formula
from loomax.plan.flops import count_step
from loomax.stages import LOSS_IN_LOOP_SCHEDULES, STAGE_AXIS, PipelineConfig


@dataclass
class StageLoop:
    """One staged loop of the program: its slots, and the FLOPs of each branch of its
    per-slot ``switch`` (one device along ``stage``; None: no switch, every slot alike)."""

    slots: int
    branch_flops: list[float] | None = None


@dataclass
class PipelineBubble:
    """A staged step's schedule and its bubble as estimates (fractions of the slots)."""

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int
    slots: int
    """The compiled loop's slots (its trip count); 0 where no staged loop was found."""
    busy: int
    """Slots each stage works in, per the schedule."""
    formula: float
    slots_bubble: float | None
    counted: float | None
    lockstep: float | None
    """The explicit loop only (GPipe's slots are alike: its ``slots_bubble``)."""

    def to_json(self) -> dict:
        return asdict(self)


def schedule_bubble(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """``pipeline_schedules.formula`` for a ``trainer.pipeline.schedule`` name (``interleaved``
    is the table's ``circular``)."""
    name = "circular" if schedule == "interleaved" else schedule
    return formula(name, stages, microbatches, virtual)


def stage_loops(jaxpr: Any) -> list[StageLoop]:
    """The slot loops of every ``shard_map`` manual over ``stage`` in ``jaxpr``: the
    outermost ``scan`` in each (a GPipe step has two, the forward and its transpose)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map" and STAGE_AXIS in _manual(eqn):
            for sub in _subjaxprs(eqn.params):
                out += [_loop(scan) for scan in _outer_scans(sub)]
        else:
            for sub in _subjaxprs(eqn.params):
                out += stage_loops(sub)
    return out


def pipeline_bubble(jaxpr: Any, pipeline: PipelineConfig, stages: int) -> PipelineBubble:
    """``pipeline``'s schedule on ``stages`` stages and its bubble, from the traced step
    ``jaxpr`` (its staged loop) and the schedule's table."""
    name, v = pipeline.schedule, pipeline.virtual_stages
    m = pipeline.microbatches_for(stages)
    loops = stage_loops(jaxpr)
    slots = max((loop.slots for loop in loops), default=0)
    explicit = name in LOSS_IN_LOOP_SCHEDULES
    codes = _codes(name, stages, m, v) if explicit else None
    busy = (
        round(sum(int(c != 0) for row in codes for c in row) / stages)
        if codes is not None
        else v * m
    )
    slots_bubble = (slots - busy) / slots if slots else None
    counted = lockstep = None
    if not explicit:
        counted = slots_bubble
    else:
        branches = next((x.branch_flops for x in loops if x.branch_flops), None)
        used = sorted({c for row in codes for c in row})
        if branches is not None and len(branches) == len(used) and slots == len(codes):
            flops = dict(zip(used, branches, strict=True))
            work = sum(flops[c] for row in codes for c in row)
            most = max(branches)
            if most > 0:
                counted = 1 - work / (slots * stages * most)
                longest = sum(max(flops[c] for c in row) for row in codes)
                lockstep = 1 - work / (longest * stages)
    return PipelineBubble(
        name, stages, m, v, slots, busy, schedule_bubble(name, stages, m, v),
        slots_bubble, counted, lockstep,
    )  # fmt: skip


def _codes(name: str, p: int, m: int, v: int) -> list[list[int]]:
    """The explicit loop's branch code per slot and stage (``pipeline_explicit.control``)."""
    from loomax.models.blocks.pipeline_explicit import control

    ctrl, _, _ = control(name, p, m, v)
    return ctrl[..., 0].tolist()


def _loop(scan) -> StageLoop:
    """A slot loop: its length and, where its body has a ``switch`` (a ``cond`` of more
    than two branches, the largest), each branch's FLOPs."""
    body = scan.params["jaxpr"]
    switch = max(_conds(body), key=lambda e: len(e.params["branches"]), default=None)
    flops = None
    if switch is not None and len(switch.params["branches"]) > 2:
        flops = [count_step(b).total_flops for b in switch.params["branches"]]
    return StageLoop(int(scan.params["length"]), flops)


def _outer_scans(jaxpr: Any) -> list:
    """The ``scan`` equations of ``jaxpr`` not inside another ``scan`` (nor a ``cond``)."""
    return _outermost(jaxpr, "scan", "cond")


def _conds(jaxpr: Any) -> list:
    """The ``cond`` equations of ``jaxpr`` outside any inner ``scan`` or ``cond``."""
    return _outermost(jaxpr, "cond", "scan")


def _outermost(jaxpr: Any, name: str, stop: str) -> list:
    """The ``name`` equations of ``jaxpr``, looking inside sub-jaxprs but not into a ``name``
    or ``stop`` equation's."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            out.append(eqn)
        elif eqn.primitive.name != stop:
            for sub in _subjaxprs(eqn.params):
                out += _outermost(sub, name, stop)
    return out


def _manual(eqn) -> set[str]:
    mesh = eqn.params["mesh"]
    return set(eqn.params.get("newly_manual_axes") or getattr(mesh, "axis_names", ()))


def _subjaxprs(params: dict) -> list:
    from jax.extend import core as jex_core

    found = []
    for value in params.values():
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, jex_core.ClosedJaxpr | jex_core.Jaxpr):
                found.append(item)
    return found


def bubble_text(pipeline: dict) -> str:
    """One line for ``loomax compile``'s report (``PipelineBubble.to_json``'s dict)."""
    p = pipeline
    chunks = f", {p['virtual_stages']} chunks a device" if p["virtual_stages"] > 1 else ""
    parts = [f"formula {_pct(p['formula'])}", f"slots {_pct(p['slots_bubble'])}"]
    parts.append(f"counted {_pct(p['counted'])}")
    if p.get("lockstep") is not None:
        parts.append(f"lockstep {_pct(p['lockstep'])}")
    return (
        f"pipeline: {p['schedule']} over {p['stages']} stages, {p['microbatches']} microbatches"
        f"{chunks}: a loop of {p['slots']} slots, each stage busy in {p['busy']}; bubble "
        f"(estimates): {', '.join(parts)}"
    )


def _pct(x: float | None) -> str:
    return "?" if x is None or not math.isfinite(x) else f"{x:.1%}"
