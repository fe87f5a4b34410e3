"""Skip bad steps: a step whose loss spikes leaves the weights unchanged and is reported."""

from __future__ import annotations

import json

import numpy as np

from loomax.callbacks import LogMetricsHook, SkipBadStepsHook


def test_spiking_step_is_skipped(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=8, loss_fn=tiny.spiking_loss())
    trainer.add_hook(SkipBadStepsHook(window=10, k=3.0, min_history=4))
    trainer.add_hook(LogMetricsHook(log_every=1, tokens_per_step=64))
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
