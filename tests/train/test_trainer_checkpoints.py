"""The trainer and its checkpoints: the start checkpoint, hooks holding temporary saves back,
a failed save stopping the run at once, and runs sharing a base_path."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from loomax.checkpoint import CheckpointerConfig, CheckpointSaveError, KeepPolicy, list_checkpoints
from loomax.data import BatchLoader, TokenWindows
from loomax.errors import UserError
from loomax.lm import lm_loss
from loomax.models import Gpt2Config
from loomax.optim import AdamConfig
from loomax.tracking import NoopTrackerConfig
from loomax.train import Hook, Trainer, TrainerConfig, check_restore_sources, process, setup_process
from loomax.train.restore import CheckpointOwnerError

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=2)
VOCAB, BATCH = 48, 4
"""tests/train/tiny_setup.py's model, batch and optimizer: with a constant learning rate the
train step is one program whatever ``num_train_steps`` is, so every run here after the
first (and the trainer and hook tests) loads it from the compilation cache."""


def make_config(run_dir, steps=8, run_id=None, **checkpointer):
    return TrainerConfig(
        num_train_steps=steps,
        train_batch_size=BATCH,
        run_dir=str(run_dir),
        run_id=run_id,
        tracker=NoopTrackerConfig(),
        progress_bar=False,
        checkpointer=CheckpointerConfig(**{"keep": [KeepPolicy(every=2)], **checkpointer}),
    )


def trainer_for(config, run_id=None):
    steps = config.num_train_steps
    opt = AdamConfig(learning_rate=1e-3, warmup=0, lr_schedule="constant")
    return Trainer(
        config, opt.build(steps), lm_loss(), lr_schedule=opt.lr_scheduler(steps), run_id=run_id
    )


def make_trainer(run_dir, steps=8, run_id=None, **checkpointer):
    return trainer_for(make_config(run_dir, steps, run_id, **checkpointer))


def train(trainer):
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    tokens = np.random.default_rng(1).integers(0, VOCAB, 30 * MODEL.seq_len, dtype=np.int32)
    batches = BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=3)
    return trainer.train(state, batches.iter_from(int(state.step)))


def steps(path):
    return [c.step for c in list_checkpoints(str(path))]


def test_checkpoint_before_the_first_step(tmp_path):
    train(make_trainer(tmp_path, steps=2, save_at_start=True))
    first = list_checkpoints(str(tmp_path / "checkpoints"))[0]
    assert first.step == 0 and first.pinned and first.permanent
    assert steps(tmp_path / "checkpoints") == [0, 2]


class MergeWindow(Hook):
    """Holds temporary saves back during steps 3-5, as a merge window might."""

    def blocks_temporary_saves(self, step):
        return 3 <= step <= 5


def test_hooks_hold_temporary_saves_back(tmp_path):
    trainer = make_trainer(
        tmp_path,
        steps=7,
        keep=[KeepPolicy(every=10**6)],
        save_interval=None,
        save_interval_steps=1,
        removal="never",
        save_at_end=False,
    )
    trainer.add_hook(MergeWindow())
    train(trainer)
    assert steps(tmp_path / "checkpoints") == [1, 2, 6, 7]


class Fill(Hook):
    """Puts a file where the checkpoint of ``step`` goes: its directory cannot be made."""

    def __init__(self, base, step):
        self.base, self.step, self.seen = base, step, []

    def on_step(self, info):
        self.seen.append(info.step)
        if info.step == self.step - 1:
            self.base.mkdir(parents=True, exist_ok=True)
            (self.base / f"step-{self.step}").write_text("in the way")


def test_a_failed_save_stops_the_run_at_once_and_the_next_start_resumes(tmp_path):
    base = tmp_path / "checkpoints"
    # saves at steps 2 and 4 only: no later save would surface the error by waiting for it
    policy = {"keep": [KeepPolicy(every=10**6)], "fixed_steps": [2, 4], "save_at_end": False}
    trainer = make_trainer(tmp_path, steps=40, run_id="r1", **policy)
    blocker = trainer.add_hook(Fill(base, 4))
    with pytest.raises(CheckpointSaveError, match=r"checkpoint step 4 could not be written") as e:
        train(trainer)
    assert isinstance(e.value, UserError)  # one line on the command line, exit 2
    assert "resumes from the newest, step 2" in str(e.value)
    assert max(blocker.seen) < 40  # stopped once the background write had failed
    assert steps(base) == [2]  # the complete checkpoint is untouched
    (base / "step-4").unlink()
    resumed = make_trainer(tmp_path, steps=12, run_id="r1", **policy)
    final = train(resumed)
    assert resumed.restored_from.step == 2 and final.step == 12


def test_runs_sharing_a_base_path_do_not_resume_each_other(tmp_path):
    shared = str(tmp_path / "shared")
    train(make_trainer(tmp_path / "a", steps=2, run_id="a", base_path=shared))
    other = make_trainer(tmp_path / "b", steps=4, run_id="b", base_path=shared)
    with pytest.raises(
        CheckpointOwnerError, match=r"another run \(a, newest step 2\); this run is b"
    ):
        check_restore_sources(other.config, other.checkpointer.directory.url, other.run_id)
    with pytest.raises(CheckpointOwnerError, match="trainer.load_checkpoint_path"):
        train(other)
    # the same run resumes; another run resumes it only when told to
    assert train(make_trainer(tmp_path / "a", steps=4, run_id="a", base_path=shared)).step == 4
    told = make_trainer(tmp_path / "c", steps=6, run_id="c")
    told.config = dataclasses.replace(told.config, load_checkpoint_path=shared)
    assert train(told).step == 6 and told.restored_from.run_id == "a"


class Crash(Hook):
    """Kills the run (an exception out of the loop) at step ``step``."""

    def __init__(self, step):
        self.step = step

    def on_step(self, info):
        if info.step == self.step:
            raise RuntimeError("killed by the test")


def test_the_same_command_again_resumes_its_run(tmp_path, monkeypatch):
    """``trainer.run_dir`` and a shared ``checkpointer.base_path``, no ``run_id``: the same
    command started again (a new process) continues its run, exactly; a command with
    another run dir is another run and is still refused."""
    shared = str(tmp_path / "shared")
    policy = {"base_path": shared, "fixed_steps": [4], "async_save": False, "save_at_end": False}
    config = make_config(tmp_path / "run", steps=8, **policy)

    def start(config):  # as `loomax train` does, in a fresh process
        monkeypatch.setattr(process, "_shared_run_ids", {})
        run_id = setup_process(config)
        check_restore_sources(config, shared, run_id)
        return trainer_for(config, run_id)

    first = start(config)
    first.add_hook(Crash(6))
    with pytest.raises(RuntimeError, match="killed by the test"):
        train(first)
    assert steps(shared)[-1] == 4  # the newest before the crash
    again = start(config)
    assert again.run_id == first.run_id
    final = train(again)
    assert again.restored_from.step == 4 and final.step == 8
    whole = trainer_for(make_config(tmp_path / "whole", steps=8, save_at_end=False), "whole")
    expected = train(whole).state.model
    for got, want in zip(
        jax.tree.leaves(final.state.model), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    other = make_config(tmp_path / "other", steps=8, **policy)
    with pytest.raises(CheckpointOwnerError, match=rf"another run \({first.run_id}, newest step 8"):
        start(other)


def test_append_run_id_keeps_runs_apart(tmp_path):
    shared = str(tmp_path / "shared")
    for run_id in ("a", "b"):
        trainer = make_trainer(
            tmp_path / run_id,
            steps=2,
            run_id=run_id,
            base_path=shared,
            append_run_id_to_base_path=True,
        )
        train(trainer)
        assert trainer.restored_from is None
    assert steps(tmp_path / "shared" / "a") == [2] and steps(tmp_path / "shared" / "b") == [2]
