"""Garbage collector: turn off Python's automatic GC during training and collect every N steps.

Automatic collections pause the host at random steps (long with many live objects);
collecting on a fixed cadence keeps step times even. GC is restored when training ends.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from loomax.train.hook_config import HookConfig, HookContext, check_positive
from loomax.train.hooks import Hook, StepInfo


class GarbageCollectorHook(Hook):
    """``gc.disable()`` at the start, ``gc.collect(generation)`` every ``every`` steps."""

    def __init__(self, every: int = 1000, generation: int = 1):
        self.every = every
        self.generation = generation
        self.collections = 0
        self._was_enabled: bool | None = None

    def on_train_begin(self, info: StepInfo) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()

    def on_step(self, info: StepInfo) -> None:
        gc.collect(self.generation)
        self.collections += 1

    def on_train_end(self, info: StepInfo) -> None:
        self._restore()

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None


@HookConfig.register_subclass("gc")
@dataclass(frozen=True)
class GarbageCollectorConfig(HookConfig):
    """Disable automatic garbage collection and collect every N steps instead."""

    every: int = 1000
    """Collect every this many steps."""
    generation: int = 1
    """Oldest generation collected on the cadence (0-2; a full collection runs at the start)."""

    def __post_init__(self):
        check_positive(self, "every")
        if self.generation not in (0, 1, 2):
            raise ValueError(
                f"trainer.hooks (gc): generation must be 0, 1 or 2, got {self.generation}"
            )

    def build(self, context: HookContext) -> Hook:
        return GarbageCollectorHook(self.every, self.generation)
