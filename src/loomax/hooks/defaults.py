"""The hooks every training run has, as the ``trainer`` section asks, built by the same registry as YAML hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loomax.hooks.config_saver import ConfigSaverHook
from loomax.hooks.ema import EmaHook
from loomax.hooks.eval import EvalHook
from loomax.hooks.log_metrics import LogMetricsHook
from loomax.hooks.nan_check import NanCheckHook
from loomax.hooks.progress import ProgressBarHook
from loomax.hooks.speed import SpeedMonitorHook
from loomax.train.hook_config import HookConfig

if TYPE_CHECKING:
    from loomax.train.config import TrainerConfig


def default_hooks(trainer: TrainerConfig) -> list[HookConfig]:
    """Configs of a run's own hooks, in the order they are added (before ``trainer.hooks``).

    The resolved config's saver; a progress bar (``progress_bar``); the NaN check
    (``crash_on_nan``); the weights' average (``model_averaging``); the evaluation (``steps_per_eval``, ``eval_at_start``,
    ``max_eval_batches``); train metrics and throughput every ``log_every`` steps.
    """
    hooks: list[HookConfig] = [ConfigSaverHook.Config()]
    if trainer.progress_bar:
        hooks.append(ProgressBarHook.Config())
    if trainer.crash_on_nan:
        hooks.append(NanCheckHook.Config())
    if trainer.model_averaging is not None:
        hooks.append(EmaHook.Config.of_run(trainer.model_averaging))
    hooks += [
        EvalHook.Config.of_run(trainer),
        LogMetricsHook.Config(every=trainer.log_every),
        SpeedMonitorHook.Config(every=trainer.log_every),
    ]
    return hooks
