"""train_lm with trainer.num_train_epochs: steps from the token cache's size, epoch events."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from loomax.config import parse_config
from loomax.data import build_lm_datasets
from loomax.lm import TrainLmConfig
from loomax.train import Hook, HookConfig, hook_type
from loomax.train_lm import train_lm

pytestmark = pytest.mark.usefixtures("ray_cluster")  # one local Ray for the cache build


@hook_type("test_epoch_probe")
class EpochProbe(Hook):
    """Keeps the epoch events it saw (on the class: the run builds the hook itself)."""

    seen: list = []

    @dataclass(frozen=True)
    class Config(HookConfig):
        every: int = 1
        """Run every step."""

    def on_epoch_begin(self, info, epoch):
        EpochProbe.seen.append(("begin", epoch))

    def on_epoch_end(self, info, epoch):
        EpochProbe.seen.append(("end", epoch, info.step))


def test_num_train_epochs_runs_that_many_passes(tmp_path, tiny_corpus):
    args = {
        "data.train": f'[{{"urls": ["{tiny_corpus}"]}}]',
        "data.tokenizer_vocab_size": "300",
        "data.cache_dir": str(tmp_path / "cache"),
        "model.seq_len": "32", "model.hidden_dim": "16", "model.num_layers": "1",
        "model.num_heads": "2",
        "trainer.train_batch_size": "8",
        "trainer.num_train_epochs": "1.5",
        "trainer.hooks": '[{"type": "test_epoch_probe"}]',
        "trainer.eval_at_start": "false",
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(tmp_path / "run"),
        "sample.enabled": "false",
    }  # fmt: skip
    config = parse_config(TrainLmConfig, None, [x for k, v in args.items() for x in (f"--{k}", v)])
    EpochProbe.seen.clear()
    result = train_lm(config)
    windows = build_lm_datasets(config.data, config.model.seq_len).num_train_windows  # cached
    assert result.final.step == math.ceil(1.5 * windows / 8) != 40  # 8 sequences a step
    assert EpochProbe.seen == [("begin", 0), ("end", 0, math.ceil(windows / 8)), ("begin", 1)]
