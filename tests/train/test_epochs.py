"""training_steps (the loop as a generator), epochs and the step-begin event, on a tiny run."""

from __future__ import annotations

import itertools

import pytest

from loomax.config import ConfigError
from loomax.lm import lm_loss
from loomax.optim import AdamConfig
from loomax.tracking import NoopTrackerConfig
from loomax.train import Hook, Trainer, TrainerConfig


class Events(Hook):
    """Records the epoch and step events in order."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    def on_epoch_begin(self, info, epoch):
        self.seen.append(("begin", epoch, info.step))

    def on_step_begin(self, step):
        self.seen.append(("step_begin", step))

    def on_step(self, info):
        self.seen.append(("step", info.step, info.epoch))

    def on_epoch_end(self, info, epoch):
        self.seen.append(("end", epoch, info.step))


def make(tiny, tmp_path, epoch_size=10, **overrides):
    config = TrainerConfig(
        train_batch_size=4, run_dir=str(tmp_path / "run"), progress_bar=False,
        tracker=NoopTrackerConfig(), **overrides,
    )  # fmt: skip
    opt = AdamConfig(learning_rate=1e-3, warmup=0, lr_schedule="constant")
    trainer = Trainer(config, opt.build(100), lm_loss(), epoch_size=epoch_size)
    events = Events()
    trainer.add_hook(events)
    return trainer, events


def test_num_train_epochs_sets_the_steps_and_epoch_events_nest(tiny, tmp_path):
    # 10 sequences an epoch, 4 a step: steps 1-3 are epoch 0 (step 3 ends it), 4-5 epoch 1
    trainer, events = make(tiny, tmp_path, num_train_epochs=2)
    assert trainer.config.num_train_steps == 5
    final = trainer.train(tiny.init(trainer), tiny.batches())
    assert final.step == 5
    assert events.seen[:4] == [
        ("begin", 0, 0),
        ("step_begin", 1),
        ("step", 1, 0),
        ("step_begin", 2),
    ]
    ends = [e for e in events.seen if e[0] in ("begin", "end")]
    assert ends == [("begin", 0, 0), ("end", 0, 3), ("begin", 1, 3), ("end", 1, 5)]


def test_a_resumed_run_continues_the_same_epoch(tiny, tmp_path):
    whole, whole_events = make(tiny, tmp_path / "whole", num_train_epochs=2)
    expected = whole.train(tiny.init(whole), tiny.batches())

    first, _ = make(tiny, tmp_path / "split", num_train_epochs=2)
    first.add_hook(lambda info: info.step == 2 and info.control.stop("test"))  # saves at step 2
    assert first.train(tiny.init(first), tiny.batches()).step == 2
    again, events = make(tiny, tmp_path / "split", num_train_epochs=2)
    state = tiny.init(again)
    assert int(state.step) == 2
    final = again.train(state, itertools.islice(tiny.batches(), 2, None))  # batches from step 2
    after = whole_events.seen.index(("step", 2, 0)) + 1
    assert events.seen == whole_events.seen[after:]  # mid-epoch 0: no second begin of it
    assert final.loss == expected.loss


def test_training_steps_yields_every_step_and_break_ends_without_closing_save(tiny, tmp_path):
    trainer, events = make(tiny, tmp_path, num_train_steps=6, epoch_size=None)
    seen = []
    for info in trainer.training_steps(tiny.init(trainer), tiny.batches()):
        seen.append((info.step, info.epoch))
        if info.step == 3:
            info.control.save()  # taken at the end of this step
        if info.step == 4:
            break
    assert seen == [(1, None), (2, None), (3, None), (4, None)]
    assert (tmp_path / "run" / "checkpoints" / "step-3" / "metadata.json").exists()
    assert not (tmp_path / "run" / "checkpoints" / "step-4").exists()  # no closing save
    assert ("step_begin", 5) not in events.seen


def test_num_train_epochs_needs_an_epoch_size(tiny, tmp_path):
    with pytest.raises(ConfigError, match="trainer.num_train_epochs needs the size of an epoch"):
        make(tiny, tmp_path, num_train_epochs=1, epoch_size=None)
    with pytest.raises(ValueError, match="trainer.num_train_epochs must be > 0"):
        TrainerConfig(num_train_epochs=0)
