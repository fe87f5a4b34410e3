"""Dropout (``model.embed_pdrop``, ``resid_pdrop``, ``attn_pdrop``): driven by the train
step's key, deterministic given the seed and step, off without a key (evaluation,
generation), and exactly absent at rate 0 (the default)."""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

from loomax.config import ConfigError
from loomax.lm import lm_loss
from loomax.models import Gpt2Config, LlamaConfig
from loomax.models.decoding.generate import sample_tokens
from loomax.train import TrainerState, make_train_step

VOCAB = 41
RATES = {"embed_pdrop": 0.1, "resid_pdrop": 0.1, "attn_pdrop": 0.1}
TINY = {
    "gpt2": Gpt2Config(seq_len=16, hidden_dim=16, num_layers=2, num_heads=2),
    "llama": LlamaConfig(seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2),
}


def batch(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (4, 16), dtype=np.int32)


OPTIMIZER = optax.sgd(0.1)


@functools.cache
def train_step(config):
    """The jitted train step of ``config``'s model (compiled once per config)."""
    del config  # the model arrives in the state; the cache keys the compiled step by config
    return jax.jit(make_train_step(lm_loss(None), OPTIMIZER, mp=jmp.get_policy("f32")))


def two_steps(config, seed: int) -> list[float]:
    """Train losses of two SGD steps from ``trainer.seed``-like key ``seed``."""
    model = config.build(VOCAB, key=jax.random.PRNGKey(0))
    state = TrainerState(
        jnp.zeros((), jnp.int32),
        model,
        OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array)),
        jax.random.PRNGKey(seed),
    )
    step = train_step(config)
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch())
        losses.append(float(metrics["train/loss"]))
    return losses


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_dropout_is_driven_by_the_step_key_and_deterministic(model_type):
    plain = TINY[model_type]
    dropped = dataclasses.replace(plain, **RATES)
    base, first, again, other = (
        two_steps(plain, 1),
        two_steps(dropped, 1),
        two_steps(dropped, 1),
        two_steps(dropped, 2),
    )
    assert first == again  # same seed, same steps: the same masks
    assert first[0] != base[0] and first != other  # dropout acts, and follows the seed
    assert two_steps(plain, 2) == base  # no dropout: the key does not matter


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_no_key_or_zero_rates_drop_nothing(model_type):
    plain = TINY[model_type]
    dropped = dataclasses.replace(plain, **RATES)
    tokens = hax.named(batch(), ("batch", "position"))
    key = jax.random.PRNGKey(3)
    model = plain.build(VOCAB, key=jax.random.PRNGKey(0))
    same = dropped.build(VOCAB, key=jax.random.PRNGKey(0))  # the same weights
    want = model.logits(tokens).array
    np.testing.assert_array_equal(same.logits(tokens).array, want)  # evaluation: no key
    np.testing.assert_array_equal(model.logits(tokens, key=key).array, want)
    assert not np.array_equal(same.logits(tokens, key=key).array, want)
    jaxpr = str(jax.make_jaxpr(lambda k: model.logits(tokens, key=k).array)(key))
    assert "random_bits" not in jaxpr and "threefry" not in jaxpr  # rate 0: nothing drawn


def test_generation_drops_nothing():
    dropped = dataclasses.replace(TINY["gpt2"], **RATES)
    model = dropped.build(VOCAB, key=jax.random.PRNGKey(0))
    plain = TINY["gpt2"].build(VOCAB, key=jax.random.PRNGKey(0))  # the same weights
    greedy = dict(seq_len=16, max_new_tokens=4, temperature=0.0, key=jax.random.PRNGKey(3))
    for use_cache in (True, False):
        got = sample_tokens(model, [1, 2, 3], use_cache=use_cache, **greedy)
        assert got == sample_tokens(plain, [1, 2, 3], use_cache=use_cache, **greedy)


def test_each_rate_acts_alone():
    tokens = hax.named(batch(), ("batch", "position"))
    key = jax.random.PRNGKey(3)
    want = TINY["gpt2"].build(VOCAB, key=jax.random.PRNGKey(0)).logits(tokens).array
    for name in RATES:
        config = dataclasses.replace(TINY["gpt2"], **{name: 0.5})
        got = config.build(VOCAB, key=jax.random.PRNGKey(0)).logits(tokens, key=key).array
        assert not np.allclose(got, want), name


def test_bad_rates_and_backends_name_the_key():
    with pytest.raises(ConfigError, match="model.resid_pdrop"):
        dataclasses.replace(TINY["gpt2"], resid_pdrop=1.0)
    with pytest.raises(ConfigError, match="model.embed_pdrop"):
        dataclasses.replace(TINY["llama"], embed_pdrop=-0.1)
    with pytest.raises(ConfigError, match="model.attn_pdrop.*attn_backend"):
        dataclasses.replace(TINY["llama"], attn_pdrop=0.1, attn_backend="blockwise")
