"""The trainer loop: hook cadence and order, decorator form, NaN crash, single compile, tracker records."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import pytest

from loomax.hooks import NanCheckHook, NonFiniteLossError
from loomax.lm import lm_loss
from loomax.train import Hook, JitHook, StepInfo, TrainerConfig


@pytest.fixture
def make_trainer(tiny):
    """The shared tiny trainer (tests/train/tiny_setup.py): one model and a constant learning
    rate, so the train step's program is the same whatever the step count, and each test
    after the first (and the hook tests) loads it from the compilation cache."""
    return tiny.trainer


@pytest.fixture
def batches(tiny):
    return tiny.batches


@pytest.fixture
def init(tiny):
    return tiny.init


def test_hook_every_and_decorator_form(tmp_path, make_trainer, batches, init):
    trainer = make_trainer(tmp_path, steps=7)
    seen = {"every1": [], "every3": [], "decorated": []}
    trainer.add_hook(lambda info: seen["every1"].append(info.step), every=1)
    trainer.add_hook(lambda info: seen["every3"].append(info.step), every=3)

    @trainer.add_hook(every=2)
    def decorated(info: StepInfo):
        seen["decorated"].append((info.step, round(info.loss, 6)))

    final = trainer.train(init(trainer), batches())
    assert seen["every1"] == [1, 2, 3, 4, 5, 6, 7]
    assert seen["every3"] == [3, 6]
    assert [s for s, _ in seen["decorated"]] == [2, 4, 6]
    assert final.step == 7 and int(final.state.step) == 7
    decorated(final)  # the decorator returns the function itself, still callable as such
    assert seen["decorated"][-1] == (7, round(final.loss, 6))


def test_hooks_run_in_registration_order_with_lifecycle(tmp_path, make_trainer, batches, init):
    trainer = make_trainer(tmp_path, steps=2)
    calls = []

    class Recorder(Hook):
        def __init__(self, name):
            self.label = name

        def on_train_begin(self, info):
            calls.append((self.label, "begin", info.step))

        def on_step(self, info):
            calls.append((self.label, "step", info.step))

        def on_train_end(self, info):
            calls.append((self.label, "end", info.step, info.previous.step))

    trainer.add_hook(Recorder("a"))
    trainer.add_hook(Recorder("b"))
    trainer.train(init(trainer), batches())
    assert calls == [
        ("a", "begin", 0),
        ("b", "begin", 0),
        ("a", "step", 1),
        ("b", "step", 1),
        ("a", "step", 2),
        ("b", "step", 2),
        ("a", "end", 2, 2),
        ("b", "end", 2, 2),
    ]


def test_previous_step_is_one_behind_and_finished(tmp_path, make_trainer, batches, init):
    trainer = make_trainer(tmp_path, steps=4)
    previous = []
    trainer.add_hook(
        lambda info: previous.append(None if info.previous is None else info.previous.step)
    )
    trainer.train(init(trainer), batches())
    assert previous == [None, 1, 2, 3]


def test_step_compiles_once(tmp_path, make_trainer, batches, init):
    trainer = make_trainer(tmp_path, steps=5)
    trainer.train(init(trainer), batches())
    assert trainer.compilations() == 1


def nan_after(step_to_break):
    base = lm_loss()

    def loss_fn(model, tokens, *, key=None):
        (total, weight), _ = base(model, tokens, key=key)
        poison = jnp.where(
            tokens[0, 0] == -1, jnp.nan, 0.0
        )  # the test sets a -1 token to break a step
        return total + poison, weight

    return loss_fn


def test_nan_loss_stops_with_clear_error(tmp_path, make_trainer, batches, init):
    trainer = make_trainer(tmp_path, steps=10, loss_fn=nan_after(3))
    trainer.add_hook(NanCheckHook())
    seen = []
    trainer.add_hook(lambda info: seen.append(info.step))

    def poisoned():
        for i, b in enumerate(batches()):
            if i == 2:
                b = b.copy()
                b[0, 0] = -1
            yield b

    with pytest.raises(NonFiniteLossError, match="training loss is nan at step 3"):
        trainer.train(init(trainer), poisoned())
    assert max(seen) <= 4  # stopped at most one step after the bad one


def test_jsonl_records_contract(tmp_path, make_trainer, batches, init):
    from loomax.hooks import LogMetricsHook, SpeedMonitorHook

    trainer = make_trainer(tmp_path, steps=6)
    trainer.add_hook(LogMetricsHook(every=2, tokens_per_step=64))
    trainer.add_hook(
        SpeedMonitorHook(every=2, tokens_per_step=64, flops_per_token=1e6, peak_flops=1e12)
    )
    trainer.train(init(trainer), batches())
    trainer.finish()
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in records:
        for key in (
            "train/loss",
            "optim/learning_rate",
            "optim/grad_norm",
            "throughput/tokens_per_second",
            "throughput/mfu",
        ):
            assert key in r, key
        assert r["throughput/tokens_per_second"] > 0


def test_jit_hook_via_add_hook(tmp_path, make_trainer, batches, init):
    """A JitHook's outputs reach whoever holds it (``info.traced``), never the shared metrics."""
    trainer = make_trainer(tmp_path, steps=4)
    seen = JitHook(lambda ctx: {"debug/step_seen": ctx.step.astype(jnp.float32)})
    every2 = JitHook(lambda ctx: {"debug/every2": ctx.step.astype(jnp.float32) + 1}, every=2)
    trainer.add_hook(seen)
    trainer.add_hook(every2)
    values, shared = [], []
    trainer.add_hook(lambda info: values.append(info.traced(seen)["debug/step_seen"]))
    trainer.add_hook(lambda info: values.append(info.traced(every2)["debug/every2"]), every=2)
    trainer.add_hook(lambda info: shared.append(set(info.host_metrics())))
    trainer.train(init(trainer), batches())
    assert values == [0.0, 1.0, 2.0, 2.0, 3.0, 4.0]
    assert all(not any(k.startswith("debug/") for k in keys) for keys in shared)
    with pytest.raises(RuntimeError, match="before the first call"):
        trainer.add_hook(JitHook(lambda ctx: {}))


def test_batch_must_divide_over_microbatches():
    with pytest.raises(ValueError, match="per_device_parallelism"):
        TrainerConfig(train_batch_size=8, per_device_parallelism=3).microbatches(jax.device_count())
    assert TrainerConfig(train_batch_size=8, per_device_parallelism=2).microbatches(1) == 4
    assert TrainerConfig(train_batch_size=8).microbatches(1) == 1


def test_max_train_time_stops_cleanly_and_runs_end_hooks(tmp_path, make_trainer, batches, init):
    from datetime import timedelta

    trainer = make_trainer(tmp_path, steps=50, max_train_time=timedelta(seconds=0))
    ended = []

    class End(Hook):
        def on_train_end(self, info):
            ended.append((info.step, info.previous.step))

    trainer.add_hook(End())
    final = trainer.train(init(trainer), batches())
    assert final.step == 1 and ended == [(1, 1)]


def test_step_k_plus_1_is_dispatched_before_waiting_on_step_k(
    tmp_path, make_trainer, batches, init
):
    """Step k-1 is seen finished (``info.previous.finished_at``) only after step k was
    dispatched: the host never leaves the device idle while it waits."""
    trainer = make_trainer(tmp_path, steps=4)
    dispatched = {}
    step_fn = trainer.train_step

    def dispatch(state, batch):
        dispatched[len(dispatched) + 1] = time.perf_counter()
        return step_fn(state, batch)

    trainer.train_step = dispatch  # the public step, timed
    seen = []
    trainer.add_hook(lambda info: seen.append((info.step, info.previous)))
    durations = []
    trainer.add_hook(lambda info: durations.append(info.step_duration), every=2)
    final = trainer.train(init(trainer), batches())
    assert [(step, prev.step if prev else None) for step, prev in seen] == [
        (1, None),
        (2, 1),
        (3, 2),
        (4, 3),
    ]
    for step, previous in seen[1:]:
        assert previous.finished_at > dispatched[step]  # k-1 waited on after k was queued
    assert final.previous.step == 4
    assert len(durations) == 2 and all(d is not None and d > 0 for d in durations)
