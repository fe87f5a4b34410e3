"""Pipeline parallelism's settings (``trainer.pipeline``) and the ones in context.

The ``stage`` mesh axis (``trainer.mesh.stage``) splits a model's stacked layers into
consecutive stages, one per device of a ``stage`` group; ``PipelineConfig`` says how the
batch flows through them (the schedule, the pipeline's microbatches, the layer chunks per
device). ``MeshRuntime.mesh_context`` enters ``pipelining`` with the run's settings, and the
layer stack (``loomax.models.blocks.pipeline``) reads them with ``current_pipeline`` while tracing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

STAGE_AXIS = "stage"
"""The mesh axis a model's layers are split over (pipeline parallelism)."""

LOSS_IN_LOOP_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")
"""Schedules that run each microbatch's loss and backward inside the loop, slot by slot
(``loomax.models.blocks.pipeline_explicit``, following ``loomax.pipeline_schedules``' table)."""
EXECUTED_SCHEDULES = ("gpipe", "interleaved", *LOSS_IN_LOOP_SCHEDULES)
"""Schedules the staged step runs (``loomax.models.blocks.pipeline``)."""
INTERLEAVED_SCHEDULES = ("interleaved", "interleaved_1f1b")
"""Schedules with ``virtual_stages`` layer chunks per device."""


@dataclass(frozen=True)
class PipelineConfig:
    """How a batch flows through the ``stage`` mesh axis (used when trainer.mesh.stage > 1)."""

    schedule: str = "gpipe"
    """gpipe (all forwards, then the backward by autodiff), interleaved (gpipe with virtual_stages chunks per device, circular), 1f1b, interleaved_1f1b or zero_bubble (the loss and an explicit backward per slot)."""
    microbatches: int = -1
    """Pipeline microbatches each (per-device-parallelism) batch is split into; -1 = twice the stages."""
    virtual_stages: int = 1
    """Layer chunks per device (interleaved, interleaved_1f1b): device s holds chunks s, s + stages, s + 2 x stages, ..."""

    def __post_init__(self):
        if self.schedule not in EXECUTED_SCHEDULES:
            raise ValueError(
                f"trainer.pipeline.schedule must be one of {EXECUTED_SCHEDULES}, got {self.schedule!r}"
            )
        if self.microbatches == 0 or self.microbatches < -1:
            raise ValueError(
                f"trainer.pipeline.microbatches must be > 0 or -1, got {self.microbatches}"
            )
        if self.virtual_stages < 1:
            raise ValueError(
                f"trainer.pipeline.virtual_stages must be >= 1, got {self.virtual_stages}"
            )
        if self.virtual_stages > 1 and self.schedule not in INTERLEAVED_SCHEDULES:
            raise ValueError(
                "trainer.pipeline.virtual_stages > 1 needs trainer.pipeline.schedule: "
                "interleaved or interleaved_1f1b"
            )

    def microbatches_for(self, stages: int) -> int:
        """The pipeline microbatches with ``stages`` stages (-1 resolved)."""
        return 2 * stages if self.microbatches == -1 else self.microbatches


_PIPELINE = contextvars.ContextVar[PipelineConfig | None]("loomax_pipeline", default=None)


@contextlib.contextmanager
def pipelining(config: PipelineConfig | None) -> Iterator[None]:
    """Within it, ``current_pipeline()`` is ``config`` (None: the defaults)."""
    token = _PIPELINE.set(config)
    try:
        yield
    finally:
        _PIPELINE.reset(token)


def current_pipeline() -> PipelineConfig:
    """The pipeline settings in context (``PipelineConfig()`` outside any ``pipelining``)."""
    config = _PIPELINE.get()
    return PipelineConfig() if config is None else config
