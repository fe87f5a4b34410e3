"""Built-in hooks, one per module: progress bar, metric logging, eval, NaN check."""

from loomax.callbacks.eval import EvalHook, make_loss_evaluator
from loomax.callbacks.log_metrics import LogMetricsHook
from loomax.callbacks.nan_check import NanCheckHook, NonFiniteLossError
from loomax.callbacks.progress import ProgressBarHook

__all__ = [
    "EvalHook",
    "LogMetricsHook",
    "NanCheckHook",
    "NonFiniteLossError",
    "ProgressBarHook",
    "make_loss_evaluator",
]
