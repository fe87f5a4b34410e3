"""Norms hook: global and per-parameter grad/param/update norms and histograms, computed in the step."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import pytest

from loomax.callbacks import LogMetricsHook, NormsHook


def test_norms_are_logged_on_their_steps(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=4)
    trainer.add_hook(NormsHook(every=2, per_layer=True, histograms=True))
    trainer.add_hook(LogMetricsHook(every=1, tokens_per_step=64))
    final = trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = {r["step"]: r for r in map(json.loads, lines)}
    assert "norms/grad" not in records[1] and "norms/grad" not in records[3]
    for step in (2, 4):
        r = records[step]
        assert r["norms/grad"] == pytest.approx(r["optim/grad_norm"], rel=1e-5)
        assert r["norms/param"] > 0 and r["norms/update"] > 0
        assert r["norms/grad/token_embeddings/weight"] > 0
        per_layer = [k for k in r if k.startswith("norms/param/") and k.endswith("/1")]
        assert per_layer and all(k[:-2] + "/0" in r for k in per_layer)  # two stacked layers
        params = sum(x.size for x in jax.tree.leaves(eqx.filter(final.state.model, eqx.is_array)))
        assert sum(r["histograms/param"]) == params and len(r["histograms/grad"]) == 32
