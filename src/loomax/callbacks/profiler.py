"""Profiler: a ``jax.profiler`` trace of steps [start, start + num_steps) in ``<run_dir>/profile``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import jax

from loomax.train.hook_config import HookConfig, HookContext, check_positive
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)


class ProfilerHook(Hook):
    """Starts the trace after step ``start - 1`` is dispatched; stops once step ``start + num_steps - 1`` is done.

    Open the result with TensorBoard's profile plugin or Perfetto (``*.trace.json.gz``).
    """

    every = 1

    def __init__(self, directory: Path, *, start: int = 5, num_steps: int = 3):
        if start < 1 or num_steps < 1:
            raise ValueError(f"profiler start and num_steps must be >= 1, got {start}, {num_steps}")
        self.directory = Path(directory)
        self.start, self.num_steps = start, num_steps
        self.active = False
        self.done = False

    def on_train_begin(self, info: StepInfo) -> None:
        if info.step == self.start - 1:
            self._begin()

    def on_step(self, info: StepInfo) -> None:
        if info.step == self.start - 1 and not self.done:
            self._begin()
        elif self.active and info.step >= self.start + self.num_steps - 1:
            jax.block_until_ready(info.metrics)
            self._end()

    def on_train_end(self, info: StepInfo) -> None:
        self._end()

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        self._end()

    def _begin(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory))
        self.active = True
        logger.info(
            "profiling steps %d to %d into %s",
            self.start,
            self.start + self.num_steps - 1,
            self.directory,
        )

    def _end(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active, self.done = False, True


@HookConfig.register_subclass("profiler")
@dataclass(frozen=True)
class ProfilerConfig(HookConfig):
    """A jax.profiler trace of steps [start, start + num_steps) into <run_dir>/profile."""

    start: int = 5
    """First step traced (after compilation has settled)."""
    num_steps: int = 3
    """Steps traced."""
    directory: str | None = None
    """Where the trace goes; null = <run_dir>/profile."""

    def __post_init__(self):
        check_positive(self, "start", "num_steps")

    def build(self, context: HookContext) -> Hook:
        directory = Path(self.directory) if self.directory else context.run_dir / "profile"
        return ProfilerHook(directory, start=self.start, num_steps=self.num_steps)
