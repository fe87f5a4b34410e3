"""Console log lines and the progress bar follow the finished steps."""

from __future__ import annotations

from loomax.hooks import ConsoleHook, ProgressBarHook, console
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


def test_console_shows_the_chosen_metrics_at_its_interval(monkeypatch):
    metrics = {"train/loss": 2.5, "optim/grad_norm": 0.75, "optim/learning_rate": 1e-3}
    finished = CompletedStep(4, metrics, 0.5, 0.0)
    chosen = ConsoleHook(
        every=5,
        metrics=["optim/*", "train/loss"],
        tokens_per_second=False,
        total_steps=10,
        tokens_per_step=100,
    )
    chosen.on_step(StepInfo(5, None, {}, previous=finished))
    assert chosen.lines == ["step 4/10 | optim/grad_norm 0.75 | lr 0.001 | loss 2.5000"]
    now = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: now[0])
    timed = ConsoleHook(seconds=30, metrics=["train/loss"], total_steps=10, tokens_per_step=100)
    assert timed.every == 1
    for step, at in [(2, 110.0), (3, 131.0), (4, 150.0), (5, 162.0)]:
        now[0] = at
        timed.on_step(StepInfo(step, None, {}, previous=CompletedStep(step - 1, metrics, 0.5, 0.0)))
    assert [line.split(" | ")[0] for line in timed.lines] == ["step 2/10", "step 4/10"]
