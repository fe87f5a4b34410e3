"""Activation statistics: taken inside the step on the hook's steps only, equal to the
statistics of the real intermediates, and training unchanged."""

from __future__ import annotations

import json

import haliax as hax
import jax
import numpy as np
import pytest

from loomax.hooks import ActivationStatsHook, LogMetricsHook
from loomax.models import LlamaConfig
from loomax.models.axes import Position
from loomax.models.blocks import taps


def test_stats_are_logged_on_their_steps_and_training_is_unchanged(tiny, tmp_path):
    runs = {}
    for name, with_stats in (("plain", False), ("stats", True)):
        trainer = tiny.trainer(tmp_path / name, steps=4)
        if with_stats:
            trainer.add_hook(ActivationStatsHook(every=2))
        trainer.add_hook(LogMetricsHook(every=1, tokens_per_step=64))
        trainer.train(tiny.init(trainer), tiny.batches())
        trainer.finish()
        lines = (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()
        runs[name] = {r["step"]: r for r in map(json.loads, lines)}
    stats = runs["stats"]
    assert not [k for k in stats[1] | stats[3] if k.startswith("activations/")]
    for step in (2, 4):
        r = stats[step]
        for layer in ("layer_0", "layer_1"):
            for where in ("attn_out", "mlp_in", "mlp_out", "residual"):
                key = f"activations/{layer}/{where}"
                assert r[f"{key}/rms"] >= abs(r[f"{key}/mean"]) and r[f"{key}/std"] > 0
                assert r[f"{key}/absmax"] >= r[f"{key}/rms"] and 0 <= r[f"{key}/near_zero"] <= 1
        assert r["activations/final/rms"] > 0
        assert r["activations/logits/absmax"] >= r["activations/logits/rms"] > 0
    for step in (1, 2, 3, 4):  # the statistics variant trains the same model
        assert stats[step]["train/loss"] == runs["plain"][step]["train/loss"]
    with pytest.raises(ValueError, match=r"\(activations\): every must be > 0"):
        ActivationStatsHook(every=0)


def test_per_layer_stats_equal_those_of_the_layers_run_one_by_one():
    config = LlamaConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=3, num_heads=4, num_kv_heads=2
    )
    model = config.build(50, key=jax.random.PRNGKey(0))
    tokens = hax.named(jax.random.randint(jax.random.PRNGKey(1), (16,), 0, 50), Position)

    @jax.jit
    def recorded(model, tokens):
        with taps.collect() as out:
            model.hidden_states(tokens)
        return taps.flatten(out)

    @jax.jit
    def by_hand(block, x):  # one block alone (one program for the three: same shapes)
        x = block(x)
        return x, taps.stats_of(x)

    got = recorded(model, tokens)
    x = model.embed_tokens.embed(tokens)
    for i in range(3):  # each block by hand, its output's statistics
        block = jax.tree.map(
            lambda a, i=i: a["layers", i] if isinstance(a, hax.NamedArray) else a,
            model.blocks.stacked,
            is_leaf=lambda a: isinstance(a, hax.NamedArray),
        )
        x, want = by_hand(block, x)
        for stat, value in want.items():
            np.testing.assert_allclose(
                got[f"activations/layer_{i}/residual/{stat}"], value, rtol=1e-5, atol=1e-6
            )
    assert "activations/final/std" in got
    assert not taps.active()  # the collection closed with its block
