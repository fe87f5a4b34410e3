"""The pipeline-stage strategies ``loomax plan`` tries: per stage count, each schedule that
serves, with its microbatches and its bubble by the schedule's formula.

GPipe keeps every microbatch's layer inputs until the backward, so it runs ``2 p``
microbatches (bubble ``(p - 1) / (m + p - 1)``). The schedules that run the loss and the
backward inside the loop (1F1B, interleaved 1F1B, zero-bubble) hold about ``p`` microbatches'
inputs whatever ``m`` is, so they try ``4 p`` (``2 p`` where that does not split over the data
devices): a smaller bubble for about the memory. Interleaved 1F1B needs the layers to divide
into ``2 p`` chunks; none of the three runs a model of two stacks or with multi-token
prediction (DeepSeek-V3's dense first layers, ``mtp_depth``: ``explicit=False``).
The formula is an estimate of the idle share of the slots; the compiled program's own count
is read by ``plan/stage_loop.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from loomax.plan.candidates import Candidate
from loomax.plan.stage_loop import schedule_bubble

STAGES_FROM_LAYERS = 60
"""Models with at least this many layers also try pipeline stages (``stage_strategies``)."""
GPIPE_MICROBATCHES = 2
"""GPipe's microbatches per stage (it holds every one's layer inputs)."""
LOOP_MICROBATCHES = (4, 2)
"""Microbatches per stage the loss-in-loop schedules try, the first that splits over the
data devices (they hold about ``p`` microbatches' inputs, whatever ``m``)."""
INTERLEAVED_CHUNKS = 2
"""Layer chunks per device (``trainer.pipeline.virtual_stages``) for interleaved 1F1B."""


@dataclass(frozen=True)
class StagePlan:
    """One schedule on ``stages`` stages: its microbatches and layer chunks per device."""

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int = 1

    @property
    def bubble(self) -> float:
        """The formula's idle share of the slots (``pipeline_schedules.formula``): an estimate."""
        return schedule_bubble(self.schedule, self.stages, self.microbatches, self.virtual_stages)

    @property
    def held(self) -> int:
        """Microbatches whose layer inputs a stage holds at most: ``m`` (GPipe), about ``p``
        (the loss-in-loop schedules)."""
        return self.microbatches if self.schedule in ("gpipe", "interleaved") else self.stages

    @property
    def label(self) -> str:
        chunks = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"{self.schedule}{chunks} m{self.microbatches}"

    def overrides(self) -> dict:
        """The ``trainer.pipeline`` keys of this plan, in an order each step of
        ``apply_overrides`` validates (chunks a device set after an interleaved schedule,
        back to 1 before another)."""
        keys = [
            ("trainer.pipeline.schedule", self.schedule),
            ("trainer.pipeline.virtual_stages", self.virtual_stages),
        ]
        keys = keys if self.virtual_stages > 1 else keys[::-1]
        return {**dict(keys), "trainer.pipeline.microbatches": self.microbatches}


def schedule_plans(
    stages: int, layers: int, batch: int, data: int, explicit: bool = True
) -> list[StagePlan]:
    """The schedules tried on ``stages`` stages for ``layers`` layers and ``batch`` rows over
    ``data`` data-parallel devices (each microbatch splits over them): GPipe, then, where
    ``explicit``, 1F1B, interleaved 1F1B and zero-bubble; none whose microbatches do not split."""

    def splits(m: int) -> bool:
        return batch % m == 0 and (batch // m) % data == 0

    if layers % stages:
        return []
    out = []
    if splits(GPIPE_MICROBATCHES * stages):
        out.append(StagePlan("gpipe", stages, GPIPE_MICROBATCHES * stages))
    loop_m = next((k * stages for k in LOOP_MICROBATCHES if splits(k * stages)), None)
    if explicit and loop_m:
        out.append(StagePlan("1f1b", stages, loop_m))
        if layers % (INTERLEAVED_CHUNKS * stages) == 0:
            out.append(StagePlan("interleaved_1f1b", stages, loop_m, INTERLEAVED_CHUNKS))
        out.append(StagePlan("zero_bubble", stages, loop_m))
    return out


def stage_strategies(
    num_devices: int,
    num_slices: int,
    num_layers: int,
    batch: int,
    max_stage: int = 8,
    explicit: bool = True,
) -> list[Candidate]:
    """FSDP with the layers split over ``stage`` = 2, 4, 8 devices, where it divides the
    devices of a slice, under each schedule of ``schedule_plans`` (label ``fsdp pp4 32x4
    1f1b m16``: data x stage, schedule, microbatches); none for models shallower than
    ``STAGES_FROM_LAYERS``. Their estimate counts the bubble: the staged loop's slots are
    counted by its trip count (``plan/flops.py``), idle ones too."""
    if num_layers < STAGES_FROM_LAYERS:
        return []
    per_slice = num_devices // num_slices
    out = []
    stage = 2
    while stage <= min(max_stage, per_slice):
        if per_slice % stage == 0:
            data = per_slice // stage
            mesh = {"replica": num_slices, "data": data, "expert": 1, "context": 1, "model": 1}
            shape = f"{num_slices}x{data}x{stage}" if num_slices > 1 else f"{data}x{stage}"
            for plan in schedule_plans(stage, num_layers, batch, data * num_slices, explicit):
                overrides = {
                    "trainer.mesh": {**mesh, "stage": stage},
                    "trainer.fsdp_axis": "embed",
                    "trainer.shard_params": True,
                    **plan.overrides(),
                }
                out.append(Candidate(f"fsdp pp{stage} {shape} {plan.label}", overrides))
        stage *= 2
    return out
