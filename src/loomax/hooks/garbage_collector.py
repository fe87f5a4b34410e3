"""Garbage collector: turn off Python's automatic GC during training and collect every N steps.

Automatic collections pause the host at random steps (long with many live objects);
collecting on a fixed cadence keeps step times even. GC is restored when training ends.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook, StepInfo


@hook_type("gc")
class GarbageCollectorHook(Hook):
    """``gc.disable()`` at the start, ``gc.collect(generation)`` every ``every`` steps."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Disable automatic garbage collection and collect every N steps instead."""

        every: int = 1000
        """Collect every this many steps."""
        generation: int = 1
        """Oldest generation collected on the cadence (0-2; a full collection runs at the start)."""

        def __post_init__(self):
            self.check_positive("every")
            self.check(
                self.generation in (0, 1, 2),
                f"generation must be 0, 1 or 2, got {self.generation}",
            )

    config: Config

    def __init__(self, config: Config | None = None, /, **settings: Any):
        super().__init__(config, **settings)
        self.collections = 0
        self._was_enabled: bool | None = None

    def on_train_begin(self, info: StepInfo) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()

    def on_step(self, info: StepInfo) -> None:
        gc.collect(self.config.generation)
        self.collections += 1

    def on_train_end(self, info: StepInfo) -> None:
        self._restore()

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
