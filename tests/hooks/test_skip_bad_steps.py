"""Skip bad steps (now ``optimizer.skip_bad_steps``, no longer a hook): a spiking step in a
trainer leaves the weights unchanged and is reported as ``optim/skipped_step``."""

from __future__ import annotations

import json

import numpy as np

from loomax.hooks import LogMetricsHook
from loomax.optim import AdamConfig, SkipBadStepsConfig
from loomax.train import Trainer


def test_spiking_step_is_skipped(tiny, tmp_path):
    config = tiny.trainer(tmp_path, steps=8).config
    skip = SkipBadStepsConfig(rolling_interval_length=10, sigma_factor=3.0, min_history=4)
    opt = AdamConfig(learning_rate=1e-3, warmup=0, lr_schedule="constant", skip_bad_steps=skip)
    trainer = Trainer(config, opt.build(8), tiny.spiking_loss(), lr_schedule=opt.lr_scheduler(8))
    trainer.add_hook(LogMetricsHook(every=1, tokens_per_step=64))
    weights = {}
    trainer.add_hook(
        lambda info: weights.update(
            {info.step: np.asarray(info.state.model.token_embeddings.weight.array)}
        )
    )
    trainer.train(tiny.init(trainer), tiny.batches(spike_at={6}))  # batch 6 is step 7
    trainer.finish()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    skipped = {r["step"]: r["optim/skipped_step"] for r in map(json.loads, lines)}
    assert skipped == {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0, 7: 1, 8: 0}
    np.testing.assert_array_equal(weights[6], weights[7])
    assert not np.array_equal(weights[7], weights[8])
