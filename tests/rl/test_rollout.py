"""Rollouts: greedy rows equal ``sample_batch``'s, rows stop at their stop token or length,
the kept log-probs are the model's, and 8 data-parallel CPU devices sample what 1 does."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from loomax.models import LlamaConfig
from loomax.models.decoding.generate import sample_batch
from loomax.rl.batches import response_mask
from loomax.rl.loss import token_logps
from loomax.rl.rollout import generate, row_keys

WORKER = Path(__file__).with_name("rollout_devices_run.py")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [3, 3], [10, 11, 12, 13], [2]]


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2,
                         num_heads=2, num_kv_heads=1)  # fmt: skip
    return config.build(64, key=jax.random.PRNGKey(0))


def test_greedy_rollouts_are_sample_batchs_and_rows_stop_on_their_own(model):
    keys = row_keys(jax.random.PRNGKey(1), len(PROMPTS))
    got = generate(
        model, PROMPTS, keys, seq_len=32, max_new_tokens=6, temperature=0.0, stop_token=57
    )
    want = sample_batch(model, PROMPTS, seq_len=32, max_new_tokens=6, keys=keys, temperature=0.0,
                        stop_token=57)  # fmt: skip
    assert [got.tokens[i, : got.length[i]].tolist() for i in range(len(PROMPTS))] == want
    new = got.length - got.prompt_len
    assert all(n == 6 or got.tokens[i, got.length[i] - 1] == 57 for i, n in enumerate(new))
    assert any(n < 6 for n in new)  # a row stopped early at its stop token
    assert (got.tokens[np.arange(32)[None] >= got.length[:, None]] == 0).all()


def test_sampled_log_probs_are_the_models(model):
    keys = row_keys(jax.random.PRNGKey(2), len(PROMPTS))
    rolled = generate(model, PROMPTS, keys, seq_len=32, max_new_tokens=8, temperature=0.7)
    assert rolled.new_tokens == 8 * len(PROMPTS)
    forward, _ = token_logps(model, jax.numpy.asarray(rolled.tokens), temperature=0.7)
    mask = response_mask(rolled)
    sampled = np.roll(rolled.logp, -1, axis=1)  # log-prob of token t + 1, at position t
    np.testing.assert_allclose(sampled * mask, np.asarray(forward) * mask, atol=2e-5)


@pytest.mark.slow  # ~10 s: one worker process compiles the rollout for 8 devices and for 1
def test_eight_data_parallel_devices_sample_what_one_does(json_worker):
    out = json_worker(WORKER)
    eight, one = out["eight"], out["one"]
    assert (eight["data"], one["data"]) == (8, 1)
    assert eight["tokens"] == one["tokens"] and eight["length"] == one["length"]
    np.testing.assert_allclose(eight["logp"], one["logp"], atol=1e-5)
