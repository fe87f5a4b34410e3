"""Profiler: a ``jax.profiler`` trace of steps [start, start + num_steps) in ``<run_dir>/profile``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)


@hook_type("profiler")
class ProfilerHook(Hook):
    """Starts the trace after step ``start - 1`` is dispatched; stops once step ``start + num_steps - 1`` is done.

    The trace goes to ``directory`` (default ``<run_dir>/profile``). Open it with
    TensorBoard's profile plugin or Perfetto (``*.trace.json.gz``).
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """A jax.profiler trace of steps [start, start + num_steps) into <run_dir>/profile."""

        start: int = 5
        """First step traced (after compilation has settled)."""
        num_steps: int = 3
        """Steps traced."""
        directory: str | None = None
        """Where the trace goes; null = <run_dir>/profile."""

        def __post_init__(self):
            self.check_positive("start", "num_steps")

    config: Config
    every = 1

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        run_dir: str | Path | None = None,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        if self.config.directory is None and run_dir is None:
            raise ValueError("ProfilerHook needs a directory or a run_dir")
        directory = self.config.directory
        self.directory = Path(directory) if directory else Path(run_dir) / "profile"
        self.active = False
        self.done = False

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, run_dir=context.run_dir)

    @property
    def last_step(self) -> int:
        """The last step traced."""
        return self.config.start + self.config.num_steps - 1

    def on_train_begin(self, info: StepInfo) -> None:
        if info.step == self.config.start - 1:
            self._begin()

    def on_step(self, info: StepInfo) -> None:
        if info.step == self.config.start - 1 and not self.done:
            self._begin()
        elif self.active and info.step >= self.last_step:
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
            self.config.start,
            self.last_step,
            self.directory,
        )

    def _end(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active, self.done = False, True
