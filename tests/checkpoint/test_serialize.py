"""Pytrees through tensorstore: exact round trips, naming, chunking, and bad input."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loomax.checkpoint import serialize
from loomax.checkpoint.serialize import (
    CheckpointError,
    check_chunks,
    named_leaves,
    read_tree,
    snapshot,
    write_snapshot,
)
from loomax.models import Gpt2Config
from loomax.storage import Directory, to_url

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)


def a_state():
    model = MODEL.build(64, key=jax.random.PRNGKey(0))
    opt = optax.adamw(1e-3)
    return {
        "model": model,
        "opt": opt.init(eqx.filter(model, eqx.is_inexact_array)),
        "step": jnp.int32(7),
        "key": jax.random.PRNGKey(3),
        "typed_key": jax.random.key(4),
        "half": jnp.linspace(0, 1, 12, dtype=jnp.bfloat16).reshape(3, 4),
        "count": 5,
        "name": "tiny",
    }


def single_device(tree):
    return jax.tree.map(lambda x: jax.sharding.SingleDeviceSharding(jax.devices()[0]), tree)


def save_and_read(tree, url):
    snap = snapshot(tree)
    write_snapshot(snap, url, create_metadata=True)
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, tree
    )
    return snap, read_tree(url, snap.manifest(), snap.values, template, single_device(template))


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_round_trip_is_exact(tmp_path, where):
    tree = a_state()
    url = to_url(tmp_path / "ckpt") if where == "local" else "memory://roundtrip"
    snap, (loaded, missing) = save_and_read(tree, url)
    assert missing == []
    assert_trees_equal(tree, loaded)
    assert isinstance(loaded["model"].token_embeddings.weight, hax.NamedArray)
    assert loaded["half"].dtype == jnp.bfloat16
    assert snap.values == {"count": 5, "name": "tiny"}
    assert set(Directory(url).keys()) >= {"step/zarr.json", "model/token_embeddings/weight/c/0/0"}


def test_leaf_names_follow_the_pytree_paths():
    names = [name for name, _ in named_leaves(a_state())]
    assert "model/token_embeddings/weight" in names  # a NamedArray is one leaf, named by its path
    assert "opt/0/mu/blocks/stacked/mlp/up/weight" in names
    assert "opt/0/count" in names


def test_big_shards_are_split_into_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(serialize, "MAX_CHUNK_BYTES", 1024)
    tree = {"w": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)}  # 8 KiB
    snap, (loaded, _) = save_and_read(tree, to_url(tmp_path / "c"))
    assert snap.manifest()["w"]["chunks"] == [8, 32]
    assert len([k for k in Directory(to_url(tmp_path / "c")).keys() if "/c/" in k]) == 8
    np.testing.assert_array_equal(loaded["w"], tree["w"])


def test_a_leaf_that_is_not_an_array_or_json_is_refused():
    with pytest.raises(TypeError, match="leaf 'fn' of type function.*no pickle"):
        snapshot({"fn": lambda x: x, "ok": jnp.zeros(2)})


def test_shape_mismatch_names_the_array(tmp_path):
    url = to_url(tmp_path / "c")
    snap = snapshot({"w": jnp.zeros((4, 4))})
    write_snapshot(snap, url, create_metadata=True)
    template = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
    with pytest.raises(
        CheckpointError, match=r"'w' has shape \(4, 4\) in the checkpoint but \(4, 8\)"
    ):
        read_tree(url, snap.manifest(), {}, template, single_device(template))


def test_missing_leaves_are_reported_not_invented(tmp_path):
    url = to_url(tmp_path / "c")
    snap = snapshot({"a": jnp.ones(3)})
    write_snapshot(snap, url, create_metadata=True)
    template = {
        "a": jax.ShapeDtypeStruct((3,), jnp.float32),
        "b": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    loaded, missing = read_tree(url, snap.manifest(), {}, template, single_device(template))
    assert missing == ["b"] and loaded["b"] is None
    np.testing.assert_array_equal(loaded["a"], np.ones(3))


def test_lost_chunks_are_detected(tmp_path):
    url = to_url(tmp_path / "c")
    snap = snapshot({"zeros": jnp.zeros((4, 4)), "w": jnp.ones((4, 4))})
    write_snapshot(snap, url, create_metadata=True)
    keys = Directory(url).keys()
    check_chunks(url, keys, snap.manifest())  # all-zero chunks are stored too
    with pytest.raises(CheckpointError, match="'w': 1 of 1 chunks are missing"):
        check_chunks(url, [k for k in keys if k != "w/c/0/0"], snap.manifest())
    with pytest.raises(CheckpointError, match="'zeros': its zarr.json is missing"):
        check_chunks(url, [k for k in keys if k != "zeros/zarr.json"], snap.manifest())


def test_an_optimizer_slot_of_a_frozen_named_array_round_trips(tmp_path):
    # a parameter left out of training has NamedArray(None) slots in the optimizer state
    model = MODEL.build(64, key=jax.random.PRNGKey(0))
    trained = eqx.filter(model, eqx.is_inexact_array)
    trained = eqx.tree_at(
        lambda m: m.token_embeddings.weight.array, trained, None, is_leaf=lambda x: x is None
    )
    tree = {"opt": optax.adam(1e-3).init(trained)}
    _, (loaded, missing) = save_and_read(tree, to_url(tmp_path / "ckpt"))
    assert missing == [] and jax.tree.structure(loaded) == jax.tree.structure(tree)
    mu = loaded["opt"][0].mu.token_embeddings.weight
    assert isinstance(mu, hax.NamedArray) and mu.array is None
