"""Pipeline schedules as static tables: which stage runs what in each time slot, and the
bubble (the idle share of the stages' slots) read off the table.

A schedule is, per stage, an ordered list of actions on (microbatch, chunk): ``F`` (the
forward pass of a chunk of layers), ``B`` (its backward: input and weight gradients, or the
input gradient alone under ``zero_bubble``) and ``W`` (the weight gradient, ``zero_bubble``
only, run whenever the stage would otherwise wait). ``table`` places the actions in time,
each as soon as its inputs are there (the previous stage's ``F``, the next stage's ``B``;
chunks go round the ring), with a chunk's ``F`` one slot, its ``B`` two (one plus one ``W``
under ``zero_bubble``). Schedules: ``gpipe`` and ``circular`` (every forward, then every
backward; ``circular`` with ``v`` chunks per device, the order ``trainer.pipeline.schedule:
interleaved`` runs), ``1f1b``, ``interleaved_1f1b`` (Megatron's order, ``m`` a multiple of
``p``) and ``zero_bubble`` (1F1B with the backward split, ZB-H1: a stage runs a pending ``W``
before a forward that would hold more than ``p`` microbatches, 1F1B's peak).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")


class Action(NamedTuple):
    """One stage's work in one or more slots: ``kind`` F, B or W of ``microbatch``'s ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class ScheduleTable:
    """The slots of a schedule: ``slots[t][s]`` is what stage ``s`` runs at slot ``t`` (None: idle)."""

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    slots: list[list[Action | None]]

    @property
    def bubble(self) -> float:
        """The idle share of the stages' slots, from the first slot to the last."""
        idle = sum(a is None for row in self.slots for a in row)
        return idle / (len(self.slots) * self.stages)

    @property
    def peak_in_flight(self) -> float:
        """The most microbatches' activations a stage holds at once (forwards begun, backwards
        not; ``zero_bubble``: weight gradients not): ``m`` for GPipe, at most ``p`` for 1F1B
        (chunks count ``1 / v`` each)."""
        release = "W" if self.name == "zero_bubble" else "B"
        peak = 0.0
        for s in range(self.stages):
            held, last = 0, None
            for row in self.slots:
                action = row[s]
                if action is not None and action != last:
                    held += {"F": 1, release: -1}.get(action.kind, 0)
                    peak = max(peak, held / self.virtual_stages)
                last = action
        return peak


def formula(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The textbook bubble: ``(p - 1) / (v m + p - 1)`` (``v = 1`` but for the interleaved
    and circular orders); ``zero_bubble`` as ZB-H1, ``(p - 1) / (3 m + p - 1)``."""
    p, m, v = stages, microbatches, virtual_stages
    if name == "zero_bubble":
        return (p - 1) / (3 * m + p - 1)
    v = v if name in ("circular", "interleaved_1f1b") else 1
    return (p - 1) / (v * m + p - 1)


def orders(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each stage's actions in the order it runs them (``W`` left out: placed by ``table``)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {name!r}")
    if name in ("gpipe", "1f1b", "zero_bubble") and v != 1:
        raise ValueError(f"pipeline schedule {name!r} has one chunk per stage, got v={v}")
    out = []
    for s in range(p):
        if name in ("gpipe", "circular"):
            f = [Action("F", k % m, k // m) for k in range(v * m)]
            b = [Action("B", k % m, k // m) for k in reversed(range(v * m))]
            out.append(f + b)
            continue
        if name == "interleaved_1f1b":
            if m % p:
                raise ValueError(f"interleaved_1f1b needs microbatches ({m}) a multiple of {p}")
            warmup = min((p - s - 1) * 2 + (v - 1) * p, m * v)

            def item(k, forward):
                chunk = (k // p) % v
                return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk

            fwd = [Action("F", *item(k, True)) for k in range(m * v)]
            bwd = [Action("B", *item(k, False)) for k in range(m * v)]
        else:
            warmup = min(p - s - 1, m)
            fwd = [Action("F", i) for i in range(m)]
            bwd = [Action("B", i) for i in range(m)]
        steady = [a for pair in zip(fwd[warmup:], bwd, strict=False) for a in pair]
        out.append(fwd[:warmup] + steady + bwd[len(fwd) - warmup :])
    return out


def table(
    name: str, stages: int, microbatches: int, virtual_stages: int = 1, backward_slots: int = 2
) -> ScheduleTable:
    """``name``'s slots for ``stages`` stages, ``microbatches`` and ``virtual_stages`` chunks per
    stage; a whole backward (input and weight gradients) takes ``backward_slots`` slots (1: the
    executor's lockstep table, every action one slot)."""
    p, m, v = stages, microbatches, virtual_stages
    split = name == "zero_bubble"
    todo = orders(name, p, m, v)
    cost = {"F": 1, "B": 1 if split else backward_slots, "W": 1}
    done: dict[tuple[str, int, int, int], int] = {}  # (kind, stage, mb, chunk) -> end slot
    free = [0] * p
    pending: list[list[Action]] = [[] for _ in range(p)]
    held = [0] * p  # zero_bubble: forwards begun whose W has not run
    slots: list[list[Action | None]] = []
    t = 0
    while any(todo) or any(pending) or max(free) > t:
        if t > 10 * (v * m + p) * 3:
            raise RuntimeError(f"pipeline schedule {name!r}: deadlock at slot {t}")
        row: list[Action | None] = [None] * p
        for s in range(p):
            if free[s] > t:
                row[s] = slots[-1][s] if slots else None
                continue
            action = todo[s][0] if todo[s] else None
            # ZB-H1: a W first when a forward would hold more than 1F1B's peak, p microbatches
            if split and pending[s] and action is not None and action.kind == "F":
                action = None if held[s] >= p else action
            if action is not None and _ready(action, s, p, v, done, t):
                todo[s].pop(0)
            elif split and pending[s]:
                action = pending[s].pop(0)
            else:
                continue
            free[s] = t + cost[action.kind]
            done[(action.kind, s, action.microbatch, action.chunk)] = free[s]
            if split and action.kind == "B":
                pending[s].append(Action("W", action.microbatch, action.chunk))
            held[s] += {"F": 1, "W": -1}.get(action.kind, 0)
            row[s] = action
        slots.append(row)
        t += 1
    while slots and all(a is None for a in slots[-1]):
        slots.pop()
    return ScheduleTable(name, p, m, v, slots)


def _ready(action: Action, s: int, p: int, v: int, done: dict, t: int) -> bool:
    """Whether ``action``'s inputs are there at slot ``t`` (chunks go round the ring)."""
    mb, c = action.microbatch, action.chunk

    def finished(kind, stage, chunk):
        end = done.get((kind, stage, mb, chunk))
        return end is not None and end <= t

    if action.kind == "F":
        if s > 0:
            return finished("F", s - 1, c)
        return c == 0 or finished("F", p - 1, c - 1)
    if not finished("F", s, c):
        return False
    if s < p - 1:
        return finished("B", s + 1, c)
    return c == v - 1 or finished("B", 0, c + 1)
