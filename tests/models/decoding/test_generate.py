"""KV-cache decoding: greedy with the cache equals greedy without it, token for token; top-k/top-p; EOS stop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.models import Gpt2Config, LlamaConfig
from loomax.models.decoding.generate import pick_token, sample_batch, sample_tokens

VOCAB = 61
MODELS = {
    "gpt2": Gpt2Config(seq_len=32, hidden_dim=32, num_layers=2, num_heads=4),
    "llama": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
    ),
}


def sharpened(config):
    """A random model with large weights, so greedy paths branch on real logit gaps."""
    model = config.build(VOCAB, key=jax.random.PRNGKey(0))
    return jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, model)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_with_cache_equals_without(name):
    model = sharpened(MODELS[name])
    prompt = [5, 9, 2, 40, 7]
    args = dict(seq_len=32, max_new_tokens=24, temperature=0.0, key=jax.random.PRNGKey(0))
    cached = sample_tokens(model, prompt, **args)
    full = sample_tokens(model, prompt, use_cache=False, **args)
    assert cached == full
    assert len(cached) == 29 and len(set(cached[5:])) > 1


def test_stops_at_eos_and_at_seq_len():
    model = sharpened(MODELS["gpt2"])
    greedy = sample_tokens(
        model, [1, 2], seq_len=32, max_new_tokens=10, temperature=0.0, key=jax.random.PRNGKey(0)
    )
    stop = greedy[4]
    stopped = sample_tokens(
        model,
        [1, 2],
        seq_len=32,
        max_new_tokens=10,
        temperature=0.0,
        key=jax.random.PRNGKey(0),
        stop_token=stop,
    )
    assert stopped[-1] == stop and len(stopped) == greedy.index(stop, 2) + 1
    long = sample_tokens(
        model,
        list(range(40)),
        seq_len=32,
        max_new_tokens=10,
        temperature=0.0,
        key=jax.random.PRNGKey(0),
    )
    assert len(long) == 32 and long[:31] == list(range(9, 40))


def test_pick_token_top_k_and_top_p():
    logits = jnp.log(jnp.array([0.05, 0.5, 0.3, 0.15]))
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    picks = lambda **kw: np.asarray(jax.vmap(lambda k: pick_token(logits, k, **kw))(keys))  # noqa: E731
    assert set(picks(top_k=1)) == {1}
    assert set(picks(top_k=2)) == {1, 2}
    assert set(picks(top_p=0.5)) == {1}  # 0.5 alone reaches p
    assert set(picks(top_p=0.8)) == {1, 2}
    assert set(picks(temperature=1.0)) == {0, 1, 2, 3}
    assert int(pick_token(logits, keys[0], temperature=0.0)) == 1


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batch_samples_each_row_as_alone(name, temperature):
    """Rows of different prompt lengths, each at its own position, stopping on their own
    (a stop token, max_new_tokens, seq_len): the same tokens as one row at a time."""
    model = sharpened(MODELS[name])
    prompts = [[5, 9, 2, 40, 7], [3], list(range(1, 30)), [8, 8, 1]]
    keys = jax.random.split(jax.random.PRNGKey(3), len(prompts))
    args = dict(seq_len=32, max_new_tokens=9, temperature=temperature)
    alone = [sample_tokens(model, p, key=k, **args) for p, k in zip(prompts, keys, strict=True)]
    stop = alone[0][7]  # row 0 stops early on it
    alone = [
        sample_tokens(model, p, key=k, stop_token=stop, **args)
        for p, k in zip(prompts, keys, strict=True)
    ]
    together = sample_batch(model, prompts, keys=keys, stop_token=stop, rows=6, **args)
    assert together == alone
    assert len(alone[0]) == 8 and len(alone[2]) == 32 and len({len(a) for a in alone}) > 2


def test_repetition_penalty_scales_the_seen_logits():
    logits = jnp.array([2.0, 1.9, -1.0, -1.2])
    seen = jnp.array([True, False, True, False])
    key = jax.random.PRNGKey(0)
    assert int(pick_token(logits, key, temperature=0.0)) == 0
    # 2.0 / 1.5 < 1.9: the seen favourite loses to the unseen one
    assert int(pick_token(logits, key, temperature=0.0, repetition_penalty=1.5, seen=seen)) == 1
    probs = lambda **kw: np.asarray(  # noqa: E731
        jax.vmap(lambda k: pick_token(logits, k, temperature=1.0, **kw))(
            jax.random.split(key, 2000)
        )
    )
    plain, penalised = probs(), probs(repetition_penalty=2.0, seen=seen)
    assert (penalised == 2).mean() < (plain == 2).mean()  # -1.0 * 2: less likely still


@pytest.mark.parametrize("name", MODELS)
def test_repetition_penalty_stops_a_greedy_loop_and_cache_agrees(name):
    model = sharpened(MODELS[name])
    args = dict(seq_len=32, max_new_tokens=24, temperature=0.0, key=jax.random.PRNGKey(0))
    plain = sample_tokens(model, [5, 9, 2], **args)
    strong = dict(args, repetition_penalty=1e4)
    cached = sample_tokens(model, [5, 9, 2], **strong)
    assert cached == sample_tokens(model, [5, 9, 2], use_cache=False, **strong)
    assert cached != plain
    # with so strong a penalty no token comes twice while unseen ones remain likelier
    assert len(set(cached)) > len(set(plain))
    (batched,) = sample_batch(model, [[5, 9, 2]], keys=args["key"][None], **{
        k: v for k, v in strong.items() if k != "key"})  # fmt: skip
    assert batched == cached
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        sample_tokens(model, [1], **dict(args, repetition_penalty=0.0))
