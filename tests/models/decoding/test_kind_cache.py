"""A KV cache per kind of layer: the sliding-window layers of a mixed pattern decode through
window-sized rolling caches, the global layers through full ones.

A Gemma 3 that transformers built (window 8; local, local, global, local: a scanned repeat of
the pattern and a layer left over) gives the same greedy tokens past the window through the
per-kind cache, through one full cache and in transformers' ``generate``; its cache holds
what its shapes say; gpt-oss's blocks (sinks, experts) and rows decoded together agree with
a full recompute.
"""

from __future__ import annotations

import dataclasses

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.hf import load_hf
from loomax.models import LmConfig
from loomax.models.decoding.generate import _cached_steps, sample_batch, sample_tokens
from loomax.models.decoding.kind_cache import (
    KindCache,
    cache_bytes,
    init_kind_cache,
    period,
    rolled,
    uses_kinds,
)

VOCAB, WINDOW, SEQ = 61, 8, 32
KINDS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
PROMPT = [3, 1, 4, 1, 5, 9]
GREEDY = dict(seq_len=SEQ, max_new_tokens=20, temperature=0.0, key=jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """``(ours, transformers')``: a random Gemma 3 transformers built, imported."""
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
        query_pre_attn_scalar=8, sliding_window=WINDOW, layer_types=KINDS,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.5 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path)
    return load_hf(path), hf


@jax.jit
def _step(model, tokens, cache, start):
    """``[vocab]`` logits of each of ``tokens`` decoded from ``start``, and the cache."""
    hidden, cache = model.decode(hax.named(tokens, "position"), cache, start)
    return hax.dot(hidden, model.lm_head_weight(), axis="embed").array, cache


def _forced_logits(model, cache, tokens: list[int], prompt: int) -> np.ndarray:
    """The logits after each of ``tokens[prompt - 1 : -1]``: the prompt in one call, then
    a token a step (the generation's positions, its tokens forced)."""
    logits, cache = _step(model, jnp.asarray(tokens[:prompt]), cache, jnp.int32(0))
    out = [logits[-1]]
    if isinstance(cache, KindCache):
        cache = rolled(cache, jnp.int32(prompt))
    for pos in range(prompt, len(tokens) - 1):
        logits, cache = _step(model, jnp.asarray(tokens[pos : pos + 1]), cache, jnp.int32(pos))
        out.append(logits[0])
    return np.stack(out)


def test_gemma3_greedy_past_the_window_equals_one_full_cache_and_transformers(gemma3):
    """``loomax generate``'s tokens (the per-kind cache) are transformers' greedy tokens; with
    those tokens forced, each step's logits through the per-kind cache, through one full
    cache and in transformers agree (so no token choice hides a difference)."""
    import torch

    model, hf = gemma3
    assert model.layer_windows() == (WINDOW, WINDOW, None, WINDOW) and uses_kinds(model, SEQ)
    ours = sample_tokens(model, PROMPT, **GREEDY)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    assert ours == out.sequences[0].tolist() and len(ours) == 26 > 3 * WINDOW
    theirs = torch.cat(out.logits).numpy()
    by_kind = _forced_logits(model, init_kind_cache(model, (), SEQ, jnp.float32, 6), ours, 6)
    full = _forced_logits(model, model.init_cache((), SEQ, jnp.float32), ours, 6)
    np.testing.assert_allclose(by_kind, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(by_kind, theirs, rtol=1e-5, atol=1e-5)


def test_the_local_layers_keep_a_window_of_slots(gemma3):
    """The cache generation decodes from, by its own arrays: three local layers of 8 slots
    and one global layer of 32 positions, against 4 x 32 for one full cache."""
    model = gemma3[0]
    steps = _cached_steps(0.0, None, None, None)
    buffer = jnp.zeros(SEQ, jnp.int32).at[: len(PROMPT)].set(jnp.asarray(PROMPT))
    cache = steps.start(model, buffer, len(PROMPT))[0]
    assert isinstance(cache, KindCache) and cache.windows == (None, WINDOW)
    assert cache.caches[0].k.array.shape == (1, SEQ, 2, 8)  # the global layer
    assert cache.caches[1].k.array.shape == (3, WINDOW, 2, 8)  # the local layers
    assert cache.kinds == (1, 1, 0, 1) and cache.rows == (0, 1, 0, 2)
    per_position = 2 * 2 * 8 * 4  # k and v, kv heads, head size, float32
    assert cache_bytes(cache) == per_position * (SEQ + 3 * WINDOW)
    assert cache_bytes(model.init_cache((), SEQ, jnp.float32)) == per_position * 4 * SEQ


def test_rows_decoded_together_match_a_full_recompute(gemma3):
    model = gemma3[0]
    prompts, keys = [[3, 1, 4], PROMPT + [2, 6, 5, 3]], jax.random.split(jax.random.PRNGKey(0), 2)
    args = dict(seq_len=SEQ, max_new_tokens=12, temperature=0.0)
    together = sample_batch(model, prompts, keys=keys, **args)
    alone = [
        sample_tokens(model, p, use_cache=False, key=k, **args)
        for p, k in zip(prompts, keys, strict=True)
    ]
    assert together == alone


def test_gpt_oss_alternating_windows_decode_per_kind():
    """gpt-oss's blocks (sinks, experts) through a per-kind cache: a full recompute's tokens."""
    GptOss = LmConfig.get_choice_class("gpt_oss")
    base = GptOss(seq_len=SEQ, hidden_dim=16, intermediate_dim=16, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, sliding_window=4)  # fmt: skip
    config = dataclasses.replace(
        base, moe=dataclasses.replace(base.moe, num_experts=4, num_experts_per_tok=2)
    )
    model = config.build(VOCAB, key=jax.random.PRNGKey(1))
    model = jax.tree.map(lambda x: 4 * x if x.ndim > 1 else x, model)
    assert model.layer_windows() == (4, None) and uses_kinds(model, SEQ)
    args = dict(GREEDY, max_new_tokens=10)
    cached = sample_tokens(model, PROMPT, **args)
    assert cached == sample_tokens(model, PROMPT, use_cache=False, **args)


def test_the_pattern_repeats_at_its_period():
    assert period((1, 1, 0, 1)) == 3 and period((1, 0) * 3) == 2 and period((0, 1, 1)) == 3
    assert period((1,) * 5 + (0,)) == 6 and period((2, 2)) == 1
