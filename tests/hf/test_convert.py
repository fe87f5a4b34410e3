"""HF export: exact HF names and layout (checked by a numpy GPT2LMHeadModel / LlamaForCausalLM
forward, for every registered family and the Llama options), sharding, exact round trip HF -> Loomax -> HF, import with a run's config, and the
model options: those transformers has travel in config.json, the others are refused by name."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.hf import export_hf, load_hf, read_hf, special_token_ids
from loomax.hf.family import HfFamily
from loomax.hf.family import families as hf_families
from loomax.models import Gpt2Config, LlamaConfig, MixtralConfig, MoeConfig
from loomax.models.attention.rotary import Llama3Rotary

from .hf_reference import gpt2_logits, llama_logits

VOCAB = 97
CASES = {
    "gpt2": Gpt2Config(seq_len=32, hidden_dim=32, num_layers=2, num_heads=4),
    "gpt2-untied": Gpt2Config(
        seq_len=32, hidden_dim=32, num_layers=2, num_heads=4, tie_word_embeddings=False
    ),
    "llama-gqa": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
    ),
    "llama-tied-llama3-headdim": LlamaConfig(
        seq_len=32,
        hidden_dim=32,
        intermediate_dim=48,
        num_layers=2,
        num_heads=2,
        head_dim=24,
        tie_word_embeddings=True,
        rope=Llama3Rotary(theta=500000.0, factor=8.0, original_max_position_embeddings=16),
    ),
    "llama-bias": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, use_bias=True
    ),
}


def randomized(config, seed=0):
    """A model with every weight random (norm scales too), so no tensor can be misplaced
    silently. The noise is numpy's (seeded): drawn by JAX op by op, each weight shape would
    compile its own threefry, scale and add programs (~4 CPU-s over six families)."""
    model = config.build(VOCAB, key=jax.random.PRNGKey(seed))
    leaves, treedef = jax.tree.flatten(model)
    rng = np.random.default_rng(seed + 1)
    leaves = [
        jnp.asarray(np.asarray(x) + 0.1 * rng.standard_normal(x.shape).astype(x.dtype))
        for x in leaves
    ]
    return jax.tree.unflatten(treedef, leaves)


def jax_randomized(config, seed=0):
    """``randomized`` with JAX's draws (op by op): tests/hf/test_transformers.py holds every
    family to transformers at 1e-5, and the Gated DeltaNet families' f32 rounding stays
    inside it on these draws (measured), not on every draw (Qwen3.5-MoE: 5e-5 on numpy's)."""
    model = config.build(VOCAB, key=jax.random.PRNGKey(seed))
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


@pytest.mark.parametrize("case", CASES)
def test_export_matches_hf_reference_logits(tmp_path, case, families):
    model = randomized(CASES[case])
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    config, tensors = read_hf(tmp_path)
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (32,), 0, VOCAB))
    reference = gpt2_logits if config["model_type"] == "gpt2" else llama_logits
    want = reference(config, tensors, ids)
    got = families.row_logits(model, ids)  # one compiled forward, not op by op
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert config["eos_token_id"] == 0
    assert config["architectures"] == [
        "GPT2LMHeadModel" if case.startswith("gpt2") else "LlamaForCausalLM"
    ]
    tied = CASES[case].tie_word_embeddings
    assert ("lm_head.weight" in tensors) == (not tied)
    assert ("model.layers.0.mlp.up_proj.bias" in tensors) == (case == "llama-bias")


HF_TYPES = sorted(hf_families())
"""Every registered family with a Hugging Face side (all but tests/support/families.py's
``NO_HF``: `test_every_family_is_an_hf_family_or_says_why_not`)."""


def test_every_family_is_an_hf_family_or_says_why_not(families):
    """A family missing an ``HfFamily`` member would drop out of ``hf_families()``, and so
    out of every HF suite, silently: each registered type is an HF family under its own
    name, or on the explicit ``NO_HF`` list with its reason."""
    types = families.model_types()
    problems = [p for p in map(families.hf_problem, types) if p is not None]
    assert not problems, "; ".join(problems)
    assert HF_TYPES == sorted(set(types) - set(families.NO_HF))
    for model_type, reason in families.NO_HF.items():
        assert model_type in types, f"NO_HF names {model_type}, which is not registered"
        assert reason.strip(), f"NO_HF gives no reason for {model_type}"
        assert model_type not in hf_families(), f"{model_type} is an HF family: not NO_HF"


@pytest.mark.parametrize("member", ["hf_model_type", "hf_run_keys", "hf_params"])
def test_a_family_missing_an_hf_member_is_named_not_dropped(families, monkeypatch, member):
    """The guard above at work: GPT-2 without one of its HF members leaves
    ``hf_families()``; the check names the member instead of letting it go."""
    monkeypatch.delattr(Gpt2Config, member)
    assert "gpt2" not in hf_families()
    problem = families.hf_problem("gpt2")
    assert problem is not None and "model.type gpt2" in problem and member in problem


@pytest.mark.parametrize("model_type", HF_TYPES)
def test_every_family_exports_what_the_reference_computes(tmp_path, model_type, families):
    config = families.tiny_config(model_type, seq_len=32)
    assert isinstance(config, HfFamily)
    model = randomized(config)
    export_hf(model, tmp_path)
    hf, tensors = read_hf(tmp_path)
    assert (hf["model_type"], hf["architectures"]) == (model_type, [config.hf_architecture])
    experts = getattr(getattr(config, "moe", None), "num_experts", 1)
    names = set()
    for p in config.hf_params():  # each stack's layers, from its first (after dense layers)
        layers = p.where(model).resolve_axis("layers").size if p.per_layer else 1
        names |= {
            p.hf_name.format(i=p.first_layer + i, e=e)
            for i in range(layers)
            for e in range(experts)
        }
    assert set(tensors) == names
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (32,), 0, VOCAB))
    if model_type not in families.NO_REFERENCE:
        reference = gpt2_logits if model_type == "gpt2" else llama_logits
        got = families.row_logits(model, ids)  # one compiled forward, not op by op
        np.testing.assert_allclose(got, reference(hf, tensors, ids), rtol=1e-4, atol=1e-4)
    assert load_hf(tmp_path).config.hf_config(VOCAB) == config.hf_config(VOCAB)
    load_hf(tmp_path, config)  # the same architecture


def test_gpt2_conv1d_layout(tmp_path):
    export_hf(randomized(CASES["gpt2"]), tmp_path)
    _, tensors = read_hf(tmp_path)
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # [in, out]
    assert tensors["transformer.h.1.mlp.c_fc.weight"].shape == (32, 128)
    assert tensors["transformer.h.1.mlp.c_proj.weight"].shape == (128, 32)
    assert tensors["transformer.wpe.weight"].shape == (32, 32)


@pytest.mark.parametrize("case", ["gpt2-untied", "llama-tied-llama3-headdim"])
def test_round_trip_hf_loomax_hf_is_exact(tmp_path, case):
    first, second = tmp_path / "a", tmp_path / "b"
    export_hf(randomized(CASES[case]), first, max_shard_bytes=30_000)
    assert (first / "model.safetensors.index.json").is_file()
    index = json.loads((first / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    export_hf(load_hf(first), second)
    c1, t1 = read_hf(first)
    c2, t2 = read_hf(second)
    assert c1 == c2
    assert t1.keys() == t2.keys()
    for name in t1:
        assert t1[name].dtype == t2[name].dtype
        np.testing.assert_array_equal(t1[name], t2[name], err_msg=name)


def test_import_keeps_run_settings_and_checks_architecture(tmp_path):
    export_hf(randomized(CASES["llama-gqa"]), tmp_path)
    run = LlamaConfig(
        seq_len=32,
        hidden_dim=32,
        intermediate_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        attn_backend="blockwise",
        gradient_checkpointing="nested",
    )
    model = load_hf(tmp_path, run)
    assert model.config.attn_backend == "blockwise"
    wrong = LlamaConfig(seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=3, num_heads=4)
    with pytest.raises(ValueError, match="does not match the configured model"):
        load_hf(tmp_path, wrong)


def test_export_refuses_what_hf_cannot_load(tmp_path):
    qk = LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=4, qk_norm=True
    )
    with pytest.raises(ValueError, match="qk_norm"):
        export_hf(qk.build(VOCAB, key=jax.random.PRNGKey(0)), tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path / "nothing")


@pytest.mark.parametrize(
    "special, want",
    [
        (None, {"bos_token_id": None, "eos_token_id": None}),
        ({"eos_token_id": 5}, {"bos_token_id": 5, "eos_token_id": 5}),
        ({"bos_token_id": 1, "eos_token_id": 5}, {"bos_token_id": 1, "eos_token_id": 5}),
    ],
)
@pytest.mark.parametrize("case", ["gpt2", "llama-gqa"])
def test_special_token_ids_are_explicit_not_transformers_defaults(tmp_path, case, special, want):
    # absent ids make transformers assume its own (GPT-2's 50256, Llama's 1 and 2), which a
    # small or different vocabulary does not have
    export_hf(CASES[case].build(VOCAB, key=jax.random.PRNGKey(0)), tmp_path, special_tokens=special)
    config, _ = read_hf(tmp_path)
    assert {k: config[k] for k in want} == want


def test_special_token_ids_of_a_tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {"a": 0, "<|endoftext|>": 1, "<s>": 2}
    eos_only = Tokenizer(models.WordLevel({"a": 0, "<|endoftext|>": 1}, unk_token="a"))
    both = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    assert special_token_ids(eos_only) == {"bos_token_id": 1, "eos_token_id": 1}
    assert special_token_ids(both) == {"bos_token_id": 2, "eos_token_id": 1}


@pytest.mark.parametrize(
    "key, value",
    [("hybrid_norm", True), ("input_embedding_norm", True), ("use_layer_norm_weight", False)],
)
def test_export_names_the_llama_option_transformers_lacks(tmp_path, key, value):
    config = dataclasses.replace(CASES["llama-gqa"], num_layers=1, **{key: value})
    with pytest.raises(ConfigError, match=f"model.{key}: {str(not value).lower()}"):
        export_hf(config.build(VOCAB, key=jax.random.PRNGKey(0)), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_options_travel_in_config_json_and_dropout_stays_the_runs(tmp_path):
    gpt2 = dataclasses.replace(
        CASES["gpt2"], activation_function="quick_gelu", scale_attn_by_inverse_layer_idx=True,
        embed_pdrop=0.1, resid_pdrop=0.2, attn_pdrop=0.3,
    )  # fmt: skip
    assert Gpt2Config.from_hf_config(gpt2.hf_config(VOCAB)) == gpt2
    llama = dataclasses.replace(
        CASES["llama-gqa"], use_bias=True, activation_function="relu2", attn_pdrop=0.1, head_dim=8
    )
    export_hf(randomized(llama), tmp_path)
    config, tensors = read_hf(tmp_path)
    assert (config["hidden_act"], config["attention_bias"], config["mlp_bias"]) == (
        "relu2",
        True,
        True,
    )
    assert tensors["model.layers.1.self_attn.k_proj.bias"].shape == (16,)
    assert load_hf(tmp_path).config == llama
    run = dataclasses.replace(llama, attn_pdrop=0.0)  # a run's dropout is its own
    assert load_hf(tmp_path, run).config.attn_pdrop == 0.0
    config["mlp_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match="attention_bias .* and mlp_bias .* differ; model.use_bias"
    ):
        load_hf(tmp_path)


MIXTRAL = MixtralConfig(
    seq_len=32, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, moe=MoeConfig(num_experts=3, num_experts_per_tok=2, load_balance_loss_weight=0.02),
)  # fmt: skip


def test_mixtral_writes_per_expert_tensors_and_reads_them_back(tmp_path):
    model = randomized(MIXTRAL)
    export_hf(model, tmp_path)
    config, tensors = read_hf(tmp_path)
    moe = "model.layers.1.block_sparse_moe."
    assert tensors[moe + "gate.weight"].shape == (3, 32)
    assert tensors[moe + "experts.2.w1.weight"].shape == (48, 32)  # [out, in]
    assert tensors[moe + "experts.2.w2.weight"].shape == (32, 48)
    np.testing.assert_array_equal(
        tensors[moe + "experts.2.w3.weight"],
        np.asarray(model.blocks.stacked.mlp.up.array[1, 2].T),  # (layers, experts, embed, mlp)
    )
    assert not any(".mlp." in name for name in tensors)
    # HF's aux loss is k at balance, Loomax's 1: the coefficient scales by k
    assert config["router_aux_loss_coef"] == pytest.approx(0.01)
    assert load_hf(tmp_path).config == MIXTRAL


@pytest.mark.parametrize(
    "key, value",
    [("capacity_factor", 1.25), ("num_shared_experts", 1), ("score_function", "sigmoid"),
     ("norm_topk_prob", False)],
)  # fmt: skip
def test_mixtral_export_names_the_moe_option_transformers_lacks(tmp_path, key, value):
    config = dataclasses.replace(MIXTRAL, moe=dataclasses.replace(MIXTRAL.moe, **{key: value}))
    with pytest.raises(ConfigError, match=f"export needs model.moe.{key}"):
        export_hf(config.build(VOCAB, key=jax.random.PRNGKey(0)), tmp_path)
