"""model.save(dir) / loomax.load_model(dir): exact architecture and weights, no pickle, in-place updates."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import loomax
from loomax.models import Gpt2Config, LlamaConfig
from loomax.models.attention.rotary import YarnRotary


def test_save_and_load_rebuilds_the_exact_model(tmp_path):
    config = LlamaConfig(
        seq_len=16,
        hidden_dim=32,
        intermediate_dim=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        qk_norm=True,
        rope=YarnRotary(factor=2.0, original_max_position_embeddings=8),
    )
    model = config.build(53, key=jax.random.PRNGKey(0))
    model.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model.yaml"]
    loaded = loomax.load_model(tmp_path)
    assert loaded.config == config and loaded.Vocab == model.Vocab
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)


def test_save_updates_in_place(tmp_path):
    first = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=1, num_heads=2).build(
        40, key=jax.random.PRNGKey(0)
    )
    first.save(tmp_path)
    second = jax.tree.map(lambda x: x + 1.0, first)
    second.save(tmp_path)
    loaded = loomax.load_model(tmp_path)
    np.testing.assert_array_equal(
        loaded.token_embeddings.weight.array, second.token_embeddings.weight.array
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model.yaml"]


def test_load_model_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.yaml"):
        loomax.load_model(tmp_path)


def test_save_with_the_tokenizer_and_load_both(tmp_path):
    from loomax.data.tokenizer import train_bpe_tokenizer
    from loomax.errors import BadFileError
    from loomax.inference import load_for_inference

    tokenizer_path = tmp_path / "t.json"
    train_bpe_tokenizer(["the cat sat on the mat"] * 20, 280, tokenizer_path)
    model = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=1, num_heads=2).build(
        300, key=jax.random.PRNGKey(0)
    )
    model.save(tmp_path / "m", tokenizer=tokenizer_path)
    loaded, tokenizer = loomax.load_model(tmp_path / "m", with_tokenizer=True)
    assert tokenizer.encode("the cat").ids == load_tokenizer_ids(tokenizer_path, "the cat")
    assert loaded.Vocab == model.Vocab
    assert load_for_inference(tmp_path / "m").tokenizer == tmp_path / "m" / "tokenizer.json"

    model.save(tmp_path / "m")  # saved again without one: the old tokenizer goes
    assert loomax.load_model(tmp_path / "m", with_tokenizer=True)[1] is None
    small = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=1, num_heads=2).build(
        50, key=jax.random.PRNGKey(0)
    )
    small.save(tmp_path / "s", tokenizer=tokenizer)  # a Tokenizer object works too
    with pytest.raises(BadFileError, match="not this model's tokenizer"):
        loomax.load_model(tmp_path / "s", with_tokenizer=True)


def load_tokenizer_ids(path, text):
    from loomax.data.tokenizer import load_tokenizer

    return load_tokenizer(path).encode(text).ids
