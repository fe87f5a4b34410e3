"""Norms hook: global and per-parameter grad/param/update norms and histograms, computed in the step."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import numpy as np
import pytest

from loomax.hooks import LogMetricsHook, NormsHook
from loomax.hooks.norms import linear_matrices


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


def test_spectral_norms_match_the_largest_singular_values(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=2)
    trainer.add_hook(NormsHook(every=2, per_layer=False, spectral=True, power_iterations=500))
    trainer.add_hook(LogMetricsHook(every=2, tokens_per_step=64))
    before_step_2 = {}

    @trainer.add_hook(every=1)
    def keep_weights(info):  # the model step 2 starts from (its norms are of this one)
        if info.step == 1:
            before_step_2.update(
                {n: np.asarray(w) for n, w, _ in linear_matrices(info.state.model)}
            )

    trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    (record,) = [
        r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open()) if r["step"] == 2
    ]
    assert "blocks/stacked/attn/qkv/weight" in before_step_2
    for name, stacked in before_step_2.items():  # (layers, out, in)
        for layer, matrix in enumerate(stacked):
            largest = np.linalg.norm(matrix, 2)
            assert record[f"norms/spectral/{name}/{layer}"] == pytest.approx(largest, rel=1e-4)
    with pytest.raises(ValueError, match=r"\(norms\): power_iterations must be > 0"):
        NormsHook(spectral=True, power_iterations=0)
