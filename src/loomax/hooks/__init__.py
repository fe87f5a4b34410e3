"""Built-in hooks, one per module; importing this package registers their ``trainer.hooks`` types."""

from loomax.callbacks.activations import ActivationStatsHook
from loomax.callbacks.batch_size import BatchSizeScheduleHook
from loomax.callbacks.config_saver import ConfigSaverHook
from loomax.callbacks.console import ConsoleHook
from loomax.callbacks.control_server import ControlServerHook
from loomax.callbacks.defaults import default_hooks
from loomax.callbacks.divergence import DivergenceDetector, DivergenceError
from loomax.callbacks.downstream_eval import DownstreamEvalHook
from loomax.callbacks.dump_gradients import DumpGradientsHook
from loomax.callbacks.early_stopping import EarlyStoppingHook
from loomax.callbacks.ema import EmaHook
from loomax.callbacks.eval import (
    EvalHook,
    make_loss_evaluator,
    next_token_bytes,
    token_byte_lengths,
)
from loomax.callbacks.garbage_collector import GarbageCollectorHook
from loomax.callbacks.hf_export import HfExportHook
from loomax.callbacks.log_metrics import LogMetricsHook
from loomax.callbacks.memory import MemoryMonitorHook
from loomax.callbacks.metric_saver import MetricSaverHook
from loomax.callbacks.model_merge import ModelMergeHook
from loomax.callbacks.nan_check import NanCheckHook, NonFiniteLossError
from loomax.callbacks.norms import NormsHook
from loomax.callbacks.notify import NotifyHook
from loomax.callbacks.profiler import ProfilerHook
from loomax.callbacks.progress import ProgressBarHook
from loomax.callbacks.seq_len_warmup import SeqLenWarmupHook
from loomax.callbacks.skip_bad_steps import RemovedSkipBadStepsConfig  # noqa: F401 - registers the migration error
from loomax.callbacks.speed import SpeedMonitorHook
from loomax.callbacks.stability import StabilityMonitor
from loomax.callbacks.step_programs import StepProgramsHook
from loomax.callbacks.textgen import TextGenHook
from loomax.callbacks.wandb_cancel import WandbCancelHook
from loomax.config import import_package_modules

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
