"""The trainer loop: hook cadence and order, decorator form, NaN crash, single compile, tracker records."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.callbacks import NanCheckHook, NonFiniteLossError
from loomax.models import Gpt2Config
from loomax.optim import AdamConfig
from loomax.tracking import JsonlTrackerConfig
from loomax.train import Hook, JitHook, StepInfo, Trainer, TrainerConfig
from loomax.train_lm import lm_loss

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=1, num_heads=2)
VOCAB = 40


def make_trainer(tmp_path, steps=6, loss_fn=None, **overrides):
    config = TrainerConfig(
        num_train_steps=steps,
        train_batch_size=4,
        run_dir=str(tmp_path / "run"),
        tracker=JsonlTrackerConfig(),
        progress_bar=False,
        **overrides,
    )
    opt = AdamConfig(learning_rate=1e-3, warmup=0)
    return Trainer(
        config, opt.build(steps), loss_fn or lm_loss(), lr_schedule=opt.lr_scheduler(steps)
    )


def batches(seed=0):
    rng = np.random.default_rng(seed)
    while True:
        yield rng.integers(0, VOCAB, (4, MODEL.seq_len), dtype=np.int32)


def init(trainer):
    return trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))


def test_hook_every_and_decorator_form(tmp_path):
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
    assert callable(decorated)  # the decorator returns the function
    assert final.step == 7 and int(final.state.step) == 7


def test_hooks_run_in_registration_order_with_lifecycle(tmp_path):
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


def test_previous_step_is_one_behind_and_finished(tmp_path):
    trainer = make_trainer(tmp_path, steps=4)
    previous = []
    trainer.add_hook(
        lambda info: previous.append(None if info.previous is None else info.previous.step)
    )
    trainer.train(init(trainer), batches())
    assert previous == [None, 1, 2, 3]


def test_step_compiles_once(tmp_path):
    trainer = make_trainer(tmp_path, steps=5)
    trainer.train(init(trainer), batches())
    assert trainer._step_fn.jitted._cache_size() == 1


def nan_after(step_to_break):
    base = lm_loss()

    def loss_fn(model, tokens, *, key=None):
        total, weight = base(model, tokens, key=key)
        poison = jnp.where(
            tokens[0, 0] == -1, jnp.nan, 0.0
        )  # the test sets a -1 token to break a step
        return total + poison, weight

    return loss_fn


def test_nan_loss_stops_with_clear_error(tmp_path):
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


def test_jsonl_records_contract(tmp_path):
    from loomax.callbacks import LogMetricsHook, SpeedMonitorHook

    trainer = make_trainer(tmp_path, steps=6)
    trainer.add_hook(LogMetricsHook(log_every=2, tokens_per_step=64))
    trainer.add_hook(SpeedMonitorHook(2, tokens_per_step=64, flops_per_token=1e6, peak_flops=1e12))
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


def test_jit_hook_via_add_hook(tmp_path):
    trainer = make_trainer(tmp_path, steps=3)
    trainer.add_hook(JitHook(lambda ctx: {"debug/step_seen": ctx.step.astype(jnp.float32)}))
    values = []
    trainer.add_hook(lambda info: values.append(info.host_metrics()["debug/step_seen"]))
    trainer.train(init(trainer), batches())
    assert values == [0.0, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="before the first call"):
        trainer.add_hook(JitHook(lambda ctx: {}))


def test_batch_must_divide_over_microbatches():
    with pytest.raises(ValueError, match="per_device_parallelism"):
        TrainerConfig(train_batch_size=8, per_device_parallelism=3).microbatches(jax.device_count())
    assert TrainerConfig(train_batch_size=8, per_device_parallelism=2).microbatches(1) == 4
    assert TrainerConfig(train_batch_size=8).microbatches(1) == 1


def test_max_train_time_stops_cleanly_and_runs_end_hooks(tmp_path):
    from datetime import timedelta

    trainer = make_trainer(tmp_path, steps=50, max_train_time=timedelta(seconds=0))
    ended = []

    class End(Hook):
        def on_train_end(self, info):
            ended.append((info.step, info.previous.step))

    trainer.add_hook(End())
    final = trainer.train(init(trainer), batches())
    assert final.step == 1 and ended == [(1, 1)]


def test_step_k_plus_1_is_dispatched_before_waiting_on_step_k(tmp_path):
    trainer = make_trainer(tmp_path, steps=4)
    events = []
    step_fn, complete = trainer.train_step, trainer._complete  # bound methods

    def dispatch(state, batch):
        events.append(
            ("dispatch", int(state.step) + 1)
        )  # int() here is on the input state, already done
        return step_fn(state, batch)

    def wait(pending, last_done):
        events.append(("wait", pending[0]))
        return complete(pending, last_done)

    trainer.train_step, trainer._complete = dispatch, wait
    durations = []
    trainer.add_hook(lambda info: durations.append(info.step_duration), every=2)
    trainer.train(init(trainer), batches())
    assert events == [
        ("dispatch", 1),
        ("dispatch", 2),
        ("wait", 1),
        ("dispatch", 3),
        ("wait", 2),
        ("dispatch", 4),
        ("wait", 3),
        ("wait", 4),
    ]
    assert len(durations) == 2 and all(d is not None and d > 0 for d in durations)
