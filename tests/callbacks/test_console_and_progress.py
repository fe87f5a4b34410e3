"""Console log lines and the progress bar follow the finished steps."""

from __future__ import annotations

from loomax.callbacks import ConsoleHook, ProgressBarHook
from loomax.train import StepInfo
from loomax.train.hooks import CompletedStep


def done(step):
    return CompletedStep(step, {"train/loss": 2.5, "optim/learning_rate": 1e-3}, 0.5, 0.0)


def test_console_line_and_progress_bar():
    console = ConsoleHook(every=2, total_steps=10, tokens_per_step=100)
    console.on_step(StepInfo(2, None, {}, previous=done(1)))
    assert console.lines == ["step 1/10 | loss 2.5000 | lr 0.001 | 200 tok/s"]
    bar = ProgressBarHook(total_steps=10, tokens_per_step=100)
    bar.on_train_begin(StepInfo(0, None, {}))
    bar.on_step(StepInfo(3, None, {}, previous=done(2)))
    assert bar.bar.n == 3 and "2.500" in str(bar.bar.postfix)
    bar.on_train_end(StepInfo(4, None, {}, previous=done(4)))
    assert bar.bar.n == 4
