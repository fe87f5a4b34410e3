"""Batch-size schedule monitor: log each step's batch size and the data consumed so far.

With ``trainer.train_batch_size`` as stages, the tokens per step change over training;
this hook logs ``data/batch_size`` (sequences in the step), ``data/sequences`` and
``data/tokens`` (consumed up to and including the step: the sum of the batch sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loomax.batch_schedule import BatchSchedule
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo


@hook_type("batch_size_schedule")
class BatchSizeScheduleHook(Hook):
    """Logs the batch size of step ``step`` and the sequences and tokens consumed by then."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Log the batch size and the sequences and tokens consumed (follows trainer.train_batch_size)."""

        every: int = 1
        """Log every this many steps."""

        def __post_init__(self):
            self.check_positive("every")

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        schedule: BatchSchedule,
        seq_len: int,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.schedule = schedule
        self.seq_len = seq_len

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(
            config,
            schedule=context.trainer_config.batch_schedule,
            seq_len=context.model_config.seq_len,
        )

    def values(self, step: int) -> dict[str, int]:
        """What is logged at ``step`` (step ``step`` trained on batch ``step - 1``)."""
        sequences = self.schedule.offset(step)
        return {
            "data/batch_size": self.schedule.size_at(max(step - 1, 0)),
            "data/sequences": sequences,
            "data/tokens": sequences * self.seq_len,
        }

    def on_step(self, info: StepInfo) -> None:
        info.log(self.values(info.step))
