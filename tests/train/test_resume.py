"""Resuming: bitwise-identical continuation, hook state, load_checkpoint modes, initialize_from."""

from __future__ import annotations

import json
import os
import signal

import jax
import numpy as np
import pytest

from loomax.checkpoint import CheckpointerConfig, CheckpointError, KeepPolicy, list_checkpoints
from loomax.data import BatchLoader, TokenWindows
from loomax.hooks import EmaHook
from loomax.lm import lm_loss
from loomax.models import Gpt2Config
from loomax.optim import AdamConfig
from loomax.tracking import JsonlTrackerConfig, NoopTrackerConfig
from loomax.train import Hook, Trainer, TrainerConfig, check_restore_sources

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=2)
VOCAB, STEPS, BATCH = 48, 12, 4


def make_trainer(run_dir, model=MODEL, **overrides):
    settings = {
        "num_train_steps": STEPS,
        "train_batch_size": BATCH,
        "run_dir": str(run_dir),
        "tracker": NoopTrackerConfig(),
        "progress_bar": False,
        "checkpointer": CheckpointerConfig(keep=[KeepPolicy(every=4)]),
        **overrides,
    }
    config = TrainerConfig(**settings)
    opt = AdamConfig(learning_rate=3e-3, warmup=2)
    trainer = Trainer(config, opt.build(STEPS), lm_loss(), lr_schedule=opt.lr_scheduler(STEPS))
    trainer.model = model
    return trainer


def loader():
    tokens = np.random.default_rng(1).integers(0, VOCAB, 30 * MODEL.seq_len, dtype=np.int32)
    return BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=3)


def start(trainer):
    state = trainer.initial_state(lambda key: trainer.model.build(VOCAB, key=key))
    return state, loader().iter_from(int(state.step))


class Recorder(Hook):
    """Records every step's loss; its count is state that must survive a restart."""

    def __init__(self):
        self.losses: dict[int, float] = {}
        self.count = 0

    def on_step(self, info):
        self.losses[info.step] = info.loss
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def terminate_at(step):
    def hook(info):
        if info.step == step:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def params(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.model)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One whole run of ``STEPS`` steps: its losses, final parameters and model, and its
    checkpoints (4, 8, 12), which the initialize_from and partial tests read (never write)."""
    run_dir = tmp_path_factory.mktemp("full")
    trainer = make_trainer(run_dir)
    recorder = trainer.add_hook(Recorder())
    final = trainer.train(*start(trainer))
    return recorder.losses, params(final.state), final.state.model, run_dir / "checkpoints"


def test_restart_continues_bitwise_identically(tmp_path, uninterrupted):
    full_losses, full_params, _, _ = uninterrupted
    first = make_trainer(tmp_path)
    first.add_hook(Recorder())
    first.add_hook(terminate_at(6))  # preemption: the step finishes, a checkpoint is saved
    info = first.train(*start(first))
    assert info.step == 6 and first.stop_reason == "signal SIGTERM"
    saved = list_checkpoints(str(tmp_path / "checkpoints"))
    assert [(c.step, c.permanent) for c in saved] == [(4, True), (6, False)]
    assert saved[-1].metadata["data"] == {"batches_consumed": 6}
    assert saved[-1].metadata["hooks"] == {"Recorder": {"count": 6}}

    second = make_trainer(tmp_path)
    recorder = second.add_hook(Recorder())
    state, batches = start(second)
    assert int(state.step) == 6 and second.restored_from.step == 6
    final = second.train(state, batches)
    assert recorder.count == STEPS  # 6 restored + 6 new
    assert recorder.losses == {s: full_losses[s] for s in range(7, STEPS + 1)}  # exact floats
    for a, b in zip(params(final.state), full_params, strict=True):
        np.testing.assert_array_equal(a, b)
    done = list_checkpoints(str(tmp_path / "checkpoints"))
    assert [(c.step, c.permanent) for c in done] == [(4, True), (8, True), (12, True)]


def test_load_checkpoint_modes(tmp_path):
    with pytest.raises(FileNotFoundError, match="trainer.load_checkpoint is true but there is no"):
        start(make_trainer(tmp_path, load_checkpoint=True))
    trainer = make_trainer(tmp_path, num_train_steps=4)
    trainer.train(*start(trainer))
    state, _ = start(make_trainer(tmp_path, load_checkpoint=False))
    assert int(state.step) == 0
    state, _ = start(make_trainer(tmp_path))
    assert int(state.step) == 4
    elsewhere = make_trainer(
        tmp_path / "other", load_checkpoint=True, load_checkpoint_path=str(tmp_path / "checkpoints")
    )
    assert int(start(elsewhere)[0].step) == 4


def test_initialize_from_takes_weights_only(tmp_path, uninterrupted):
    _, trained, _, source = uninterrupted
    trainer = make_trainer(tmp_path / "new", initialize_from=str(source))
    trainer.add_hook(EmaHook(decay=0.9))  # hook extras start from the loaded weights too
    state, _ = start(trainer)
    assert int(state.step) == 0
    for a, b in zip(params(state), trained, strict=True):
        np.testing.assert_array_equal(a, b)
    ema = [np.asarray(x) for x in jax.tree.leaves(state.extras["ema"])]
    for a, b in zip(ema, trained, strict=True):
        np.testing.assert_array_equal(a, b)
    mu = jax.tree.leaves(state.opt_state[1].mu)
    assert all(not np.any(np.asarray(m)) for m in mu)  # a fresh optimizer


def test_missing_checkpoints_are_named_before_any_work(tmp_path):
    own = str(tmp_path / "run" / "checkpoints")
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="load_checkpoint is true but .* at .*nowhere"):
        check_restore_sources(
            TrainerConfig(load_checkpoint=True, load_checkpoint_path=missing), own
        )
    with pytest.raises(FileNotFoundError, match="trainer.initialize_from: no complete .*nowhere"):
        check_restore_sources(TrainerConfig(initialize_from=missing), own)
    assert check_restore_sources(TrainerConfig(), own) is False  # fresh: nothing required

    trainer = make_trainer(tmp_path / "run", num_train_steps=4)
    trainer.train(*start(trainer))
    # resuming wins over initialize_from, which is then never read: no error
    assert check_restore_sources(TrainerConfig(initialize_from=missing), own) is True
    with pytest.raises(FileNotFoundError, match="trainer.initialize_from"):
        check_restore_sources(TrainerConfig(initialize_from=missing, load_checkpoint=False), own)


def test_partial_checkpoints_need_permission(tmp_path, uninterrupted):
    *_, trained, source = uninterrupted
    untied = Gpt2Config(**{**MODEL.__dict__, "tie_word_embeddings": False})
    path = str(source)
    with pytest.raises(
        CheckpointError, match=r"lacks \d+ array\(s\) of the state, e\.g\. .*lm_head"
    ):
        start(make_trainer(tmp_path / "a", model=untied, load_checkpoint_path=path))
    state, _ = start(
        make_trainer(
            tmp_path / "b", model=untied, load_checkpoint_path=path, allow_partial_checkpoint=True
        )
    )
    assert int(state.step) == STEPS and state.model.lm_head is not None
    np.testing.assert_array_equal(
        state.model.token_embeddings.weight.array, trained.token_embeddings.weight.array
    )


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """The interrupted attempt logged steps 5-7 after its last checkpoint (4) before it died;
    once resumed, metrics.jsonl holds every step once, 5-7 from the resumed attempt. What
    the resumed run logs at its first step (4, like an eval at start) joins that step's record."""

    def records():
        return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    class Logging(Hook):
        def __init__(self, attempt):
            self.attempt = attempt

        def on_train_begin(self, info):
            info.log({"begin": self.attempt})

        def on_step(self, info):
            info.log({"train/loss": info.loss, "attempt": self.attempt})

    def crash_at(step):
        def hook(info):
            if info.step == step:
                raise RuntimeError("killed")

        return hook

    first = make_trainer(tmp_path, tracker=JsonlTrackerConfig())
    first.add_hook(Logging(1))
    first.add_hook(crash_at(7))
    with pytest.raises(RuntimeError, match="killed"):
        first.train(*start(first))
    assert [c.step for c in list_checkpoints(str(tmp_path / "checkpoints"))] == [4]
    assert [r["step"] for r in records()] == list(range(8))

    second = make_trainer(tmp_path, tracker=JsonlTrackerConfig())
    second.add_hook(Logging(2))
    second.train(*start(second))
    second.finish()
    logged = [(r["step"], r.get("attempt"), r.get("begin")) for r in records()]
    assert logged == [(0, None, 1)] + [
        (s, 1 if s <= 4 else 2, 2 if s == 4 else None) for s in range(1, STEPS + 1)
    ]


@pytest.mark.slow
def test_initialize_from_a_base_run_starts_lora_adapters_fresh(tmp_path, uninterrupted):
    """A LoRA run (model.lora) from a base run's checkpoint: the base weights are the
    checkpoint's, the adapters (which it lacks) start fresh with B = 0, no flag needed."""
    import dataclasses

    from loomax.models.lora.config import LoraConfig
    from loomax.models.lora.linear import adapter_layers, without_adapters

    _, trained, _, source = uninterrupted
    lora = LoraConfig(rank=2)
    model = dataclasses.replace(MODEL, lora=lora)
    trainer = make_trainer(
        tmp_path / "new",
        model=model,
        initialize_from=str(source),
        freeze=lora.freeze_patterns(),
    )
    state = trainer.initial_state(lambda key: model.for_training(model.build(VOCAB, key=key)))
    base = jax.tree.leaves(without_adapters(state.model))
    for a, b in zip(base, trained, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    layers = adapter_layers(state.model)
    assert layers and all(not np.any(np.asarray(x.lora_b.array)) for x in layers.values())
