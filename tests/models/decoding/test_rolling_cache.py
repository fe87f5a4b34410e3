"""The window-sized KV cache: a sliding-window model decodes through a cache of its window
(prompts shorter and longer than it, many wraps) and gives the tokens a full recompute
gives; its attention equals the full cache's step by step."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.models import LlamaConfig
from loomax.models.attention.attention import cached_attention
from loomax.models.config import KvCache
from loomax.models.decoding.generate import sample_tokens
from loomax.models.decoding.rolling_cache import rolling_attention, slot_positions, to_rolling

WINDOW = 4
CONFIG = LlamaConfig(
    seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
    sliding_window=WINDOW,
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return CONFIG.build(53, key=jax.random.PRNGKey(0))


def test_slots_hold_the_last_window_of_positions():
    assert CONFIG.build(53, key=jax.random.PRNGKey(0)).cache_window() == WINDOW
    np.testing.assert_array_equal(slot_positions(jnp.int32(6), 4), [4, 5, 2, 3])
    assert int(slot_positions(jnp.int32(2), 4)[3]) == jnp.iinfo(jnp.int32).max  # empty
    full = hax.named(jnp.arange(8.0), ("key_position",))
    rolled = to_rolling(KvCache(full, full), jnp.int32(7), 4)
    assert rolled.k.axis_size("key_position") == 4
    np.testing.assert_array_equal(rolled.k.array, [4.0, 5.0, 6.0, 3.0])


@pytest.mark.parametrize("prompt", [[3, 1, 4], [3, 1, 4, 1, 5, 9, 2]])
def test_greedy_with_the_window_cache_equals_a_full_recompute(model, prompt):
    args = dict(seq_len=32, max_new_tokens=14, temperature=0.0, key=jax.random.PRNGKey(0))
    cached = sample_tokens(model, prompt, **args)
    assert cached == sample_tokens(model, prompt, use_cache=False, **args)
    assert len(cached) == len(prompt) + 14


def test_rolling_attention_equals_the_full_cache_step_by_step():
    axes = (hax.Axis("position", 11), hax.Axis("kv_heads", 2), hax.Axis("head_size", 8))
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q = hax.random.normal(keys[0], (axes[0], hax.Axis("heads", 4), axes[2]))
    k, v = (hax.random.normal(key, axes) for key in keys[1:])
    cache_axes = (hax.Axis("key_position", 11), axes[1], axes[2])
    full = (hax.zeros(cache_axes), hax.zeros(cache_axes))
    ring = (hax.zeros((hax.Axis("key_position", 3), *cache_axes[1:])),) * 2
    # each a compiled program per chunk length, the window static (op by op: ~3.5x the CPU)
    full_step = jax.jit(cached_attention, static_argnums=6)
    ring_step = jax.jit(rolling_attention, static_argnums=6)
    for a, b in [(0, 5), (5, 6), (6, 7), (7, 9), (9, 10), (10, 11)]:  # a chunk past the window
        new = [x["position", a:b] for x in (q, k, v)]
        want, *full = full_step(*new, *full, jnp.int32(a), 3)
        got, *ring = ring_step(*new, *ring, jnp.int32(a), 3)
        np.testing.assert_allclose(got.array, want.array, rtol=1e-5, atol=1e-6)


def test_rows_decoded_together_at_their_own_positions_match(model):
    from loomax.models.decoding.generate import sample_batch

    prompts = [[3, 1, 4], [3, 1, 4, 1, 5, 9, 2]]
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    args = dict(seq_len=32, max_new_tokens=10, temperature=0.0)
    together = sample_batch(model, prompts, keys=keys, **args)
    alone = [
        sample_tokens(model, p, use_cache=False, key=k, **args)
        for p, k in zip(prompts, keys, strict=True)
    ]
    assert together == alone
