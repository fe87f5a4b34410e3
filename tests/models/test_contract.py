"""The model contract: every registered ``model.type`` builds, trains, saves, decodes and converts.

One suite over every type in ``LmConfig``'s registry, at a tiny size: logits on
``[batch, position, vocab]``, ``param_count`` equal to the real count, positive
``flops_per_token``, a falling loss under a few Adam steps, an exact ``model.save`` /
``load_model`` round trip, KV-cache greedy decoding equal to full recomputation, and an exact
Hugging Face export/import round trip where the type has an HF mapping.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

import loomax
from loomax.config_reference import registry_members
from loomax.hf import export_hf, load_hf
from loomax.hf.family import families as hf_families
from loomax.models import LmConfig, LmModel
from loomax.models.decoding.generate import sample_tokens

VOCAB = 97
SEQ = 32
"""tests/hf's vocabulary and length: at the same family and shapes the forward and the
KV-cache decoding steps here are the programs tests/hf/test_transformers.py compiles."""
MODEL_TYPES = [name for name, _ in registry_members(LmConfig)]
"""Every built-in model type: a family is in this suite once it is registered."""


@pytest.fixture(scope="module", params=MODEL_TYPES)
def model_type(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def config(model_type, families) -> LmConfig:
    """A tiny config of ``model_type`` (tests/support/families.py)."""
    return families.tiny_config(model_type, seq_len=SEQ)


@pytest.fixture(scope="module")
def built(config) -> LmModel:
    """The tiny model as built (eager: its init ops' compiles are shared between families of
    the same shapes; one jitted build a family costs more)."""
    return config.build(VOCAB, key=jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def model(built) -> LmModel:
    """A tiny model with weights scaled up, so greedy decoding follows real logit gaps."""
    return jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, built)


def tokens(batch: int = 2, seed: int = 1) -> hax.NamedArray:
    ids = jax.random.randint(jax.random.PRNGKey(seed), (batch, SEQ), 0, VOCAB)
    return hax.named(ids, ("batch", "position"))


def assert_same_weights(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def same_model(model_type: str, config: LmConfig, families) -> bool:
    """Whether ``model_type``'s model is another family's (``SAME_MODEL``): its forward, Adam
    and greedy checks are that family's, so here it is held to the claim instead: the same
    model class, parameter names and shapes (no skip: CI allows only listed skips)."""
    if model_type not in families.SAME_MODEL:
        return False
    other = families.tiny_config(families.SAME_MODEL[model_type], seq_len=SEQ)
    ours, theirs = (jax.eval_shape(lambda c=c: c.build(VOCAB, key=jax.random.PRNGKey(0))) for c in (config, other))  # fmt: skip
    assert type(ours) is type(theirs)

    def shapes(m):
        leaves = jax.tree_util.tree_leaves_with_path(m)
        return [(jax.tree_util.keystr(k), x.shape) for k, x in leaves]

    assert shapes(ours) == shapes(theirs)
    return True


def test_same_model_holds_for_every_listed_family(families):
    """``SAME_MODEL`` lists registered families only, each mapped to a family computed here."""
    for model_type, other in families.SAME_MODEL.items():
        assert {model_type, other} <= set(MODEL_TYPES) and other not in families.SAME_MODEL
        assert same_model(model_type, families.tiny_config(model_type, seq_len=SEQ), families)


def test_forward_gives_batch_position_vocab_logits(model_type, config, model, families):
    if same_model(model_type, config, families):
        return
    # one program, not op by op: the greedy reference (the same shapes) reads its compile
    logits = families.logits(model, tokens())
    assert [(a.name, a.size) for a in logits.axes] == [
        ("batch", 2),
        ("position", SEQ),
        ("vocab", VOCAB),
    ]
    assert model.Vocab.size == VOCAB and bool(np.isfinite(logits.array).all())


def test_param_count_and_flops(config, model):
    real = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    assert config.param_count(VOCAB) == real
    assert config.flops_per_token(VOCAB) > 0


def test_loss_falls_under_adam(model_type, config, built, families):
    if same_model(model_type, config, families):
        return
    model = built  # as built, not scaled
    # tests/hf/test_transformers.py's trained families take the same step (one compile)
    batch, state = tokens(), families.ADAM.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(6):
        model, state, loss = families.adam_step(model, state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses


def test_save_and_load_round_trip_exactly(model_type, model, tmp_path):
    model.save(tmp_path)
    loaded = loomax.load_model(tmp_path)
    assert type(loaded) is type(model) and loaded.config == model.config
    assert_same_weights(model, loaded)


def greedy_by_recomputation(
    model: LmModel, prompt: list[int], new_tokens: int, families
) -> list[int]:
    """``prompt`` and ``new_tokens`` greedy tokens, each by rerunning the whole forward
    (``families.logits`` on the [2, SEQ] buffer: the forward test's program) and taking the
    argmax at the last filled position. ``sample_tokens(use_cache=False)``'s own loop is
    tests/models/decoding/test_generate.py's."""
    out = list(prompt)
    for _ in range(new_tokens):
        buffer = np.zeros((2, SEQ), np.int32)
        buffer[0, : len(out)] = out
        logits = families.logits(model, hax.named(buffer, ("batch", "position")))
        out.append(int(np.argmax(np.asarray(logits.array[0, len(out) - 1]))))
    return out


def test_greedy_with_cache_equals_without(model_type, config, model, families):
    if same_model(model_type, config, families):
        return
    args = dict(seq_len=SEQ, max_new_tokens=10, temperature=0.0, key=jax.random.PRNGKey(0))
    cached = sample_tokens(model, [3, 1, 4], **args)
    assert cached == greedy_by_recomputation(model, [3, 1, 4], 10, families)
    assert len(cached) == 13


def test_hugging_face_round_trip(model_type, config, model, tmp_path, families):
    if model_type in families.NO_HF:  # every other type is an HF family (tests/hf)
        pytest.skip(f"{model_type} is on the no-HF list: {families.NO_HF[model_type]}")
    assert type(config) in hf_families().values(), families.hf_problem(model_type)
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    loaded = load_hf(tmp_path)
    assert type(loaded) is type(model) and loaded.Vocab == model.Vocab
    assert_same_weights(model, loaded)
