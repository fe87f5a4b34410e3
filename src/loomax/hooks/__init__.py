"""Built-in hooks, one per module; importing this package registers their ``trainer.hooks`` types."""

from loomax.config import import_package_modules
from loomax.hooks.activations import ActivationStatsHook
from loomax.hooks.batch_size import BatchSizeScheduleHook
from loomax.hooks.config_saver import ConfigSaverHook
from loomax.hooks.console import ConsoleHook
from loomax.hooks.control_server import ControlServerHook
from loomax.hooks.defaults import default_hooks
from loomax.hooks.divergence import DivergenceDetector, DivergenceError
from loomax.hooks.downstream_eval import DownstreamEvalHook
from loomax.hooks.dump_gradients import DumpGradientsHook
from loomax.hooks.early_stopping import EarlyStoppingHook
from loomax.hooks.ema import EmaHook
from loomax.hooks.eval import (
    EvalHook,
    make_loss_evaluator,
    next_token_bytes,
    token_byte_lengths,
)
from loomax.hooks.garbage_collector import GarbageCollectorHook
from loomax.hooks.hf_export import HfExportHook
from loomax.hooks.log_metrics import LogMetricsHook
from loomax.hooks.memory import MemoryMonitorHook
from loomax.hooks.metric_saver import MetricSaverHook
from loomax.hooks.model_merge import ModelMergeHook
from loomax.hooks.nan_check import NanCheckHook, NonFiniteLossError
from loomax.hooks.norms import NormsHook
from loomax.hooks.notify import NotifyHook
from loomax.hooks.profiler import ProfilerHook
from loomax.hooks.progress import ProgressBarHook
from loomax.hooks.router_collapse import RouterCollapseHook
from loomax.hooks.seq_len_warmup import SeqLenWarmupHook
from loomax.hooks.skip_bad_steps import RemovedSkipBadStepsConfig  # noqa: F401 - registers the migration error
from loomax.hooks.speed import SpeedMonitorHook
from loomax.hooks.stability import StabilityMonitor
from loomax.hooks.step_programs import StepProgramsHook
from loomax.hooks.textgen import TextGenHook
from loomax.hooks.wandb_cancel import WandbCancelHook

__all__ = [
    "ActivationStatsHook",
    "BatchSizeScheduleHook",
    "ConfigSaverHook",
    "ConsoleHook",
    "ControlServerHook",
    "DivergenceDetector",
    "DivergenceError",
    "DownstreamEvalHook",
    "DumpGradientsHook",
    "EarlyStoppingHook",
    "EmaHook",
    "EvalHook",
    "GarbageCollectorHook",
    "HfExportHook",
    "LogMetricsHook",
    "MemoryMonitorHook",
    "MetricSaverHook",
    "ModelMergeHook",
    "NanCheckHook",
    "NonFiniteLossError",
    "NormsHook",
    "NotifyHook",
    "ProfilerHook",
    "ProgressBarHook",
    "RouterCollapseHook",
    "SeqLenWarmupHook",
    "SpeedMonitorHook",
    "StabilityMonitor",
    "StepProgramsHook",
    "TextGenHook",
    "WandbCancelHook",
    "default_hooks",
    "make_loss_evaluator",
    "next_token_bytes",
    "token_byte_lengths",
]

import_package_modules(__name__, __path__)  # every module: a new file registers its hook types
