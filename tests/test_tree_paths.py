"""One naming of pytree paths for checkpoints, model.save, weight-decay regexes and norms.

The expected names below were produced by the four separate implementations this module
replaced; they are what existing checkpoints and saved models hold, so they must not change.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax

from loomax.checkpoint.serialize import named_leaves as checkpoint_leaves
from loomax.hooks.norms import _named_leaves
from loomax.models import Gpt2Config
from loomax.models.io.files import weight_leaves
from loomax.optim.mask import parameter_names, regex_mask
from loomax.tree_paths import named_leaves, path_name

TINY = Gpt2Config(seq_len=8, hidden_dim=8, num_layers=2, num_heads=2, tie_word_embeddings=False)

PARAMETERS = [
    "token_embeddings.weight",
    "position_embeddings.weight",
    "blocks.stacked.ln_attn.weight",
    "blocks.stacked.ln_attn.bias",
    "blocks.stacked.attn.qkv.weight",
    "blocks.stacked.attn.qkv.bias",
    "blocks.stacked.attn.out.weight",
    "blocks.stacked.attn.out.bias",
    "blocks.stacked.ln_mlp.weight",
    "blocks.stacked.ln_mlp.bias",
    "blocks.stacked.mlp.up.weight",
    "blocks.stacked.mlp.up.bias",
    "blocks.stacked.mlp.down.weight",
    "blocks.stacked.mlp.down.bias",
    "ln_final.weight",
    "ln_final.bias",
    "lm_head.weight",
]
"""A tiny untied GPT-2's parameters, dotted, in flattening order."""


def tiny_model():
    return TINY.build(16, key=jax.random.PRNGKey(0))


def test_weight_decay_names_are_dotted_paths():
    assert parameter_names(tiny_model()) == PARAMETERS


def test_checkpoint_names_are_slashed_paths():
    model = tiny_model()
    state = {"model": model, "opt": optax.adamw(1e-3).init(eqx.filter(model, eqx.is_inexact_array))}
    names = [name for name, _ in checkpoint_leaves(state)]
    model_names = [n for n in names if n.startswith("model/")]
    assert model_names == ["model/" + p.replace(".", "/") for p in PARAMETERS]
    assert names[len(PARAMETERS)] == "opt/0/count"
    assert names[len(PARAMETERS) + 1] == "opt/0/mu/token_embeddings/weight"
    assert [name for name, _ in checkpoint_leaves(jnp.zeros(2))] == ["root"]


def test_saved_model_names_are_jax_key_strings():
    names = [name for name, _ in weight_leaves(tiny_model())]
    assert names == ["." + p + "[<flat index 0>]" for p in PARAMETERS]


def test_norm_names_and_stacked_layers():
    leaves = _named_leaves(eqx.filter(tiny_model(), eqx.is_inexact_array))
    assert [name for name, _, _ in leaves] == [p.replace(".", "/") for p in PARAMETERS]
    stacked = {name for name, _, is_stacked in leaves if is_stacked}
    assert stacked == {p.replace(".", "/") for p in PARAMETERS if p.startswith("blocks.")}


def test_regex_mask_matches_names():
    mask = regex_mask(tiny_model(), [r"attn", r"ln_.*bias$"])
    hits = [name for name, leaf in named_leaves(mask, ".") if leaf]
    expected = [
        p
        for p in PARAMETERS
        if "attn" in p or (p.startswith(("blocks.stacked.ln_", "ln_")) and p.endswith("bias"))
    ]
    assert hits == expected


class Holder(eqx.Module):
    weights: dict
    items: list
    plain: jax.Array


def test_path_kinds():
    axis = hax.Axis("embed", 3)
    tree = Holder(
        weights={"w": hax.zeros(axis)}, items=[jnp.ones(2), {"b": jnp.zeros(1)}], plain=jnp.ones(1)
    )
    assert [n for n, _ in named_leaves(tree)] == ["weights/w", "items/0", "items/1/b", "plain"]
    assert isinstance(named_leaves(tree)[0][1], hax.NamedArray)
    assert [n for n, _ in named_leaves(tree, sep=None, whole_named_arrays=False)] == [
        ".weights['w'][<flat index 0>]",
        ".items[0]",
        ".items[1]['b']",
        ".plain",
    ]
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
    assert path_name(paths[2], ".") == "items.1.b"
    assert path_name(()) == ""
