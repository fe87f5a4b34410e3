"""Which parameters Muon orthogonalises, batched how, and scaled to which matrix shape."""

from __future__ import annotations

from types import SimpleNamespace

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import numpy as np
import pytest

from loomax.models import LlamaConfig, MixtralConfig, MoeConfig
from loomax.optim import MuonConfig
from loomax.optim.muon_matrices import muon_labels, orthogonalize_matrices
from loomax.optim.newton_schulz import batch_split, newton_schulz, orthogonalize_stacks

MOE = MixtralConfig(
    seq_len=8, hidden_dim=16, intermediate_dim=24, num_layers=2, num_heads=2, num_kv_heads=1,
    moe=MoeConfig(num_experts=3, num_experts_per_tok=2, num_shared_experts=1),
    tie_word_embeddings=False,
)  # fmt: skip
PARAMS = eqx.filter(MOE.build(32, key=jax.random.PRNGKey(0)), eqx.is_inexact_array)


def test_labels_matrices_muon_head_embeddings_norms_adam():
    labels = muon_labels(PARAMS)
    block = labels.blocks.stacked
    assert block.attn.q_proj.weight == block.attn.o_proj.weight == "muon"
    assert block.mlp.gate == block.mlp.up == block.mlp.down == "muon"  # bare expert weights
    assert block.mlp.router.weight == block.mlp.shared_down.weight == "muon"
    assert labels.lm_head.weight == "adam"  # the LM head is Adam's, as in Moonlight / Kimi
    assert labels.embed_tokens.weight == "adam"
    assert block.input_norm.weight == labels.norm.weight == "adam"
    dense = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=24, num_layers=1,
                        num_heads=2, num_kv_heads=1, tie_word_embeddings=False)  # fmt: skip
    params = eqx.filter(dense.build(32, key=jax.random.PRNGKey(0)), eqx.is_inexact_array)
    assert muon_labels(params).lm_head.weight == "adam"


def test_experts_and_layers_are_batch_dims_scaled_by_the_matrix_shape():
    up = PARAMS.blocks.stacked.mlp.up  # (layers, experts, embed, mlp)
    g = hax.NamedArray(jax.random.normal(jax.random.PRNGKey(1), up.array.shape), up.axes)
    tx = orthogonalize_matrices(5, update_rms=0.2)
    updates, _ = tx.update({"up": g}, tx.init({"up": g}))
    got = updates["up"].rearrange(("layers", "experts", "embed", "mlp")).array
    raw = g.rearrange(("layers", "experts", "embed", "mlp")).array
    scale = 0.2 * max(16, 24) ** 0.5  # one expert's (embed, mlp) matrix, not experts x mlp
    for layer in range(2):
        for expert in range(3):
            want = newton_schulz(raw[layer, expert], 5) * scale
            np.testing.assert_allclose(got[layer, expert], want, rtol=2e-4, atol=2e-5)


def test_same_shape_stacks_share_one_batch_and_equal_separate_runs():
    key = jax.random.split(jax.random.PRNGKey(2), 3)
    stacks = [
        jax.random.normal(key[0], (2, 8, 12)),
        jax.random.normal(key[1], (3, 12, 8)),  # the transposed shape joins the same batch
        jax.random.normal(key[2], (1, 5, 5)),
    ]
    out = orthogonalize_stacks(stacks, 5)
    for s, o in zip(stacks, out, strict=True):
        assert o.shape == s.shape
        np.testing.assert_allclose(o, newton_schulz(s, 5), rtol=1e-4, atol=1e-5)


def test_update_rms_scales_the_matrix_updates():
    with pytest.raises(ValueError, match="optimizer.update_rms"):
        MuonConfig(update_rms=0.0)
    linear = hnn.Linear.init(hax.Axis("embed", 8), hax.Axis("mlp", 12), key=jax.random.PRNGKey(3))
    params = {"lin": eqx.filter(linear, eqx.is_inexact_array)}
    grads = jax.tree.map(
        lambda x: x * 0 + jax.random.normal(jax.random.PRNGKey(4), x.shape), params
    )

    def update(rms):
        tx = MuonConfig(update_rms=rms).direction()
        return tx.update(grads, tx.init(params), params)[0]["lin"]

    small, big = update(0.2), update(0.4)
    np.testing.assert_allclose(big.weight.array, 2 * small.weight.array, rtol=1e-5)
    np.testing.assert_allclose(big.bias.array, small.bias.array)  # Adam's, unscaled


def test_large_stacks_split_in_place_over_their_own_batch_dims():
    # Kimi K2's experts on data 64 x expert 32: experts stay on expert (12 a chip), data takes
    # the 60 layers unevenly (XLA pads): one layer x 12 experts a chip, nothing gathered whole
    mesh = SimpleNamespace(shape={"data": 64, "expert": 32, "model": 1})
    got = batch_split((60, 384), ("layers", "experts"), mesh, ("data", "expert"))
    assert got == [("data",), ("expert",)]
    # an axis that divides a dim goes there; one with a matrix a device or fewer is left out
    mesh = SimpleNamespace(shape={"data": 4, "expert": 2})
    assert batch_split((6, 8), ("layers", "experts"), mesh, ("data", "expert")) == [
        None,
        ("expert", "data"),
    ]
    assert batch_split((1,), (), mesh, ("data",)) == [None]
