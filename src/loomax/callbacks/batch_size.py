"""Batch-size schedule monitor: log each step's batch size and the data consumed so far.

With ``trainer.train_batch_size`` as stages, the tokens per step change over training;
this hook logs ``data/batch_size`` (sequences in the step), ``data/sequences`` and
``data/tokens`` (consumed up to and including the step: the sum of the batch sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

from loomax.batch_schedule import BatchSchedule
from loomax.train.hook_config import HookConfig, HookContext, check_positive
from loomax.train.hooks import Hook, StepInfo


class BatchSizeScheduleHook(Hook):
    """Logs the batch size of step ``step`` and the sequences and tokens consumed by then."""

    def __init__(self, schedule: BatchSchedule, seq_len: int, every: int = 1):
        self.schedule = schedule
        self.seq_len = seq_len
        self.every = every

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


@HookConfig.register_subclass("batch_size_schedule")
@dataclass(frozen=True)
class BatchSizeScheduleConfig(HookConfig):
    """Log the batch size and the sequences and tokens consumed (follows trainer.train_batch_size)."""

    every: int = 1
    """Log every this many steps."""

    def __post_init__(self):
        check_positive(self, "every")

    def build(self, context: HookContext) -> Hook:
        return BatchSizeScheduleHook(
            context.trainer_config.batch_schedule, context.model_config.seq_len, self.every
        )
