"""Against transformers itself (torch CPU, both in the `test` extra): exports load with the
same logits, for GPT-2 (also with another activation and scale_attn_by_inverse_layer_idx),
Llama with GQA/MQA, every rope variant (default, linear, llama3, YaRN) and biases, and models
saved by transformers import with them; every activation_function is transformers' own; and
every registered family with an HF side (``loomax.hf.family.families``) both ways at 1e-5;
and issue 50's goal families, trained a few steps, give transformers' greedy tokens; every
family's config.json loads through AutoConfig and comes back unchanged; and issue 62's goal:
a Qwen3, Qwen3-MoE and Llama saved by transformers continue training from config.json alone.
Nothing comes from the Hub: each model is built from a config here and saved to a tmp dir
(conftest sets HF_HUB_OFFLINE)."""

from __future__ import annotations

import dataclasses
import json
import logging

import draccus
import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from loomax import cli
from loomax.cli_parser import given_values
from loomax.config import parse_config
from loomax.hf import export_hf, load_hf
from loomax.hf.config_json import model_from_hf, written_config
from loomax.lm import TrainLmConfig, hf_source, hf_type_args, with_hf_model
from loomax.models import Gpt2Config, LlamaConfig, LmConfig
from loomax.models.attention.rotary import LinearRotary, YarnRotary
from loomax.models.blocks.mlp_activations import ACTIVATION_FUNCTIONS
from loomax.models.decoding.generate import sample_tokens
from loomax.train_lm import train_lm

from .test_convert import CASES, HF_TYPES, VOCAB
from .test_convert import jax_randomized as randomized

KEY = jax.random.PRNGKey(0)

ALL = {
    **CASES,
    "llama-mqa-yarn": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=1, rope=YarnRotary(factor=4.0, original_max_position_embeddings=8),
    ),
    "llama-linear": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        rope=LinearRotary(factor=2.0),
    ),
    "gpt2-gelu-layer-scaled": Gpt2Config(
        seq_len=32, hidden_dim=32, num_layers=2, num_heads=4, activation_function="gelu",
        scale_attn_by_inverse_layer_idx=True, resid_pdrop=0.1, attn_pdrop=0.1, embed_pdrop=0.1,
    ),
    "llama-bias-gelu": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=2, use_bias=True, activation_function="gelu_new", attn_pdrop=0.1,
    ),
}  # fmt: skip
TOLERANCE = {"gpt2-gelu-layer-scaled": 1e-5, "llama-bias-gelu": 1e-5}
"""Cases compared at 1e-5 (f32); the older cases keep 1e-4."""


@pytest.fixture(scope="module")
def torch():
    """torch, imported where it is used: at collection it would cost every xdist worker ~7 s."""
    import torch

    return torch


@pytest.fixture(scope="module")
def transformers(torch):
    import transformers

    return transformers


@pytest.mark.parametrize("case", ALL)
def test_transformers_loads_the_export_with_the_same_logits(
    tmp_path, case, torch, transformers, families
):
    model = randomized(ALL[case])
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == (
        "GPT2LMHeadModel" if case.startswith("gpt2") else "LlamaForCausalLM"
    )
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (32,), 0, VOCAB))
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    got = families.row_logits(model, ids)
    tol = TOLERANCE.get(case, 1e-4)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_activation_functions_are_transformers(torch, transformers):
    from transformers.activations import ACT2FN

    x = np.linspace(-5, 5, 201, dtype=np.float32)
    for name, fn in ACTIVATION_FUNCTIONS.items():
        want = ACT2FN[name](torch.tensor(x)).numpy()
        got = np.asarray(fn(hax.named(x, "mlp")).array)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


HF_CONFIGS = {
    "gpt2": lambda transformers: transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4
    ),
    "llama-gqa": lambda transformers: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    ),
    "gpt2-relu-layer-scaled": lambda transformers: transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        activation_function="relu", scale_attn_by_inverse_layer_idx=True,
    ),
    "llama-bias-relu2": lambda transformers: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attention_bias=True, mlp_bias=True, hidden_act="relu2",
    ),
}  # fmt: skip

ROPE_PARAMETERS = {
    "llama-theta": {"rope_type": "default", "rope_theta": 500000.0},
    "llama-linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama-llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0,
    },
    "llama-yarn": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "rope_theta": 10000.0,
    },
}  # fmt: skip
"""transformers 5 saves these as `rope_parameters` (no top-level rope_theta/rope_scaling)."""


def _llama_with_rope(transformers, case: str):
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rope_parameters=dict(ROPE_PARAMETERS[case]),
    )  # fmt: skip


for _case in ROPE_PARAMETERS:
    HF_CONFIGS[_case] = lambda transformers, case=_case: _llama_with_rope(transformers, case)


@pytest.mark.parametrize("case", HF_CONFIGS)
def test_a_model_saved_by_transformers_imports_with_the_same_logits(
    tmp_path, case, torch, transformers, families
):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[case](transformers)).eval()
    with torch.no_grad():  # move every weight off its initial value (norm scales too)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (32,), 0, VOCAB))
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    got = families.row_logits(model, ids)
    tol = 1e-5 if case in ("gpt2-relu-layer-scaled", "llama-bias-relu2") else 1e-4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _logits(torch, hf, model, ids, families) -> tuple[np.ndarray, np.ndarray]:
    """``(ours, transformers')`` logits of ``ids``; ours as one compiled forward (op by op,
    a mixture of experts or a linear-attention layer compiles hundreds of small programs),
    tests/models/test_contract.py's program for the family."""
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    return families.row_logits(model, ids), want


THEIRS_TOL = {"qwen3_5_moe_text": 3e-5, "qwen3_5_text": 3e-5}
"""Where the Gated DeltaNet's f32 rounding exceeds 1e-5 on the noise transformers' parameter
order draws (measured against our float64 forward, seq 32). Qwen3.5-MoE: 2.5e-5 at one logit
of 3,104; transformers' f32 is 2.1e-5 off, ours 1.1e-5 (and transformers' Qwen3-Next gives
exactly its Qwen3.5 logits on those weights). Dense Qwen3.5: up to 2e-5 at one position;
ours is 1.4e-5 off, transformers' 3.7e-6 (our chunk size alone moves ours by 5e-6)."""


@pytest.mark.parametrize("model_type", HF_TYPES)
def test_every_family_round_trips_through_transformers(
    tmp_path, model_type, families, torch, transformers
):
    """Our export loads in transformers as the family's class with our logits (f32, 1e-5) and
    the same greedy tokens as KV-cache decoding here, and the same model with transformers'
    own new weights, saved by it, imports with its logits."""
    config = families.tiny_config(model_type, seq_len=32)
    model = randomized(config)
    export_hf(model, tmp_path / "ours", special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert type(hf).__name__ == config.hf_architecture
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (32,), 0, VOCAB))
    np.testing.assert_allclose(
        *_logits(torch, hf.eval(), model, ids, families), rtol=1e-5, atol=1e-5
    )
    # real logit gaps; numpy's product (JAX's would compile a program per weight shape)
    sharp = jax.tree.map(lambda x: jnp.asarray(np.asarray(x) * 3.0) if x.ndim >= 2 else x, model)
    export_hf(sharp, tmp_path / "sharp", special_tokens={"eos_token_id": 0})
    hf_sharp = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "sharp", dtype=torch.float32
    )
    prompt = [3, 1, 4, 1, 5]
    ours = sample_tokens(sharp, prompt, seq_len=32, max_new_tokens=8, temperature=0.0, key=KEY)
    with torch.no_grad():
        theirs = hf_sharp.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0, min_new_tokens=8,
        )[0].tolist()  # fmt: skip
    assert ours == theirs
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "theirs")
    loaded = load_hf(tmp_path / "theirs")
    assert type(loaded.config) is type(config)
    tol = THEIRS_TOL.get(model_type, 1e-5)
    np.testing.assert_allclose(*_logits(torch, hf, loaded, ids, families), rtol=tol, atol=tol)


GOAL_FAMILIES = ("qwen3", "mistral", "gemma2", "olmo2")
"""Issue 50's goal: these round-trip through transformers after training."""


@pytest.mark.parametrize("model_type", GOAL_FAMILIES)
def test_a_trained_family_generates_the_same_greedy_tokens_in_transformers(
    tmp_path, model_type, families, torch, transformers
):
    """Train a few Adam steps (on a repeating sequence, through the blocked loss), export, and
    transformers' greedy ``generate`` gives the tokens ``sample_tokens`` (``loomax generate``)
    gives, past the window of the windowed families."""
    config = families.tiny_config(model_type, seq_len=32)
    model = config.build(VOCAB, key=jax.random.PRNGKey(0))
    pattern = np.tile([3, 1, 4, 1, 5, 9, 2, 6, 7], 4)[:32]
    batch = hax.named(np.stack([pattern, np.roll(pattern, 2)]), ("batch", "position"))
    # Adam at 3e-2, blocks of 16: tests/models/test_contract.py's step for the family
    state = families.ADAM.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(12):
        model, state, loss = families.adam_step(model, state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] / 2, losses
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = [3, 1, 4, 1, 5]
    ours = sample_tokens(model, prompt, seq_len=32, max_new_tokens=12, temperature=0.0, key=KEY)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
            pad_token_id=0, min_new_tokens=12,
        )[0].tolist()  # fmt: skip
    assert ours[5:7] == [9, 2]  # it learned the sequence (measured: qwen3, mistral all of it)
    assert ours == theirs


SHAPES = {
    "tiny": {},
    "wide-mha": dict(hidden_dim=64, num_heads=8, num_kv_heads=8, intermediate_dim=96, seq_len=48),
    "mqa": dict(hidden_dim=32, num_heads=4, num_kv_heads=1, intermediate_dim=40, seq_len=24),
}
"""Shapes of every family's export loaded by AutoConfig (each key where the family has it)."""


def test_every_family_export_loads_through_autoconfig_and_comes_back_unchanged(
    tmp_path, families, transformers
):
    """For every family and shape, its config read back from a run's config.yaml: config.json
    as export writes it loads in transformers' config class (its declared types: Gemma 2's
    int query_pre_attn_scalar), and transformers' own save of that config, imported and
    written back, is unchanged (nothing listed)."""
    for model_type in HF_TYPES:
        cls = families.tiny_config(model_type).__class__
        fields = {f.name for f in dataclasses.fields(cls)}
        for name, shape in SHAPES.items():
            config = families.tiny_config(model_type, **{k: v for k, v in shape.items() if k in fields})  # fmt: skip
            out = tmp_path / model_type / name
            out.mkdir(parents=True)
            # as a run's config.yaml is read back (on main: Gemma 2's 256 became 256.0)
            kind = {"type": LmConfig.get_choice_name(type(config))}
            config = draccus.decode(LmConfig, {**kind, **yaml.safe_load(draccus.dump(config))})
            written, _ = written_config(config, VOCAB, {"torch_dtype": "float32"})
            (out / "config.json").write_text(json.dumps(written))
            theirs = transformers.AutoConfig.from_pretrained(out)
            # the class's own config class (Gemma3ForCausalLM's is Gemma3TextConfig)
            arch = getattr(transformers, config.hf_architecture)
            assert type(theirs) is arch.config_class, (model_type, name)
            theirs.save_pretrained(out / "saved")
            saved = json.loads((out / "saved" / "config.json").read_text())
            imported = model_from_hf(saved)
            assert imported.hf_config(VOCAB) == config.hf_config(VOCAB), (model_type, name)
            again, changed = written_config(imported, VOCAB, {"torch_dtype": "float32"})
            assert (again, changed) == (saved, []), (model_type, name)


GOAL_VOCAB = 300
GOAL_SHAPE = dict(
    vocab_size=GOAL_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=32, bos_token_id=None,
    eos_token_id=None,
)  # fmt: skip
GOAL_HF = {
    "llama": dict(intermediate_size=64),
    "qwen3": dict(intermediate_size=64),
    "qwen3_moe": dict(
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, router_aux_loss_coef=0.001,
    ),
}  # fmt: skip
GOAL_STEPS = 3


@pytest.fixture(scope="module")
def data_args(tmp_path_factory, tiny_corpus):
    cache = tmp_path_factory.mktemp("cache")
    return [
        "--data.train", json.dumps([{"urls": [str(tiny_corpus)]}]),
        "--data.tokenizer_vocab_size", str(GOAL_VOCAB), "--data.validation_fraction", "0.1",
        "--data.cache_dir", str(cache),
        "--trainer.train_batch_size", "4", "--trainer.num_train_steps", str(GOAL_STEPS),
        "--trainer.eval_at_start", "false", "--trainer.max_eval_batches", "1",
        "--trainer.progress_bar", "false", "--trainer.mp", "f32",
        "--trainer.hooks", json.dumps([{"type": "hf_export", "every": 1000, "validate": False}]),
        "--optimizer.learning_rate", "0.01", "--optimizer.warmup", "0",
        "--sample.enabled", "false",
    ]  # fmt: skip


def saved_by_transformers(torch, transformers, model_type, path):
    """A tiny model of ``model_type`` saved by transformers, its weights spread out (std 0.1)
    so that greedy decoding has clear winners."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **GOAL_SHAPE, **GOAL_HF[model_type])
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return json.loads((path / "config.json").read_text())


def same_greedy_tokens(torch, transformers, families, path, prompt, n=8):
    """``(ours, theirs)``: transformers' greedy continuation of ``prompt`` from the export at
    ``path``, and ours as the argmax after each of its prefixes (one forward pass: the same
    tokens exactly when greedy decoding here would give them)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0].tolist()  # fmt: skip
    logits = families.row_logits(load_hf(path), np.asarray(theirs))
    ours = prompt + np.asarray(logits).argmax(-1)[len(prompt) - 1 : -1].tolist()
    return ours, theirs


@pytest.mark.slow
@pytest.mark.parametrize("model_type", GOAL_HF)
def test_a_transformers_checkpoint_continues_exports_and_decodes_alike(
    tmp_path, model_type, torch, transformers, data_args, caplog, capsys, families
):
    """Issue 62's goal: a tiny model saved by transformers (random weights, no Hub) trains
    with `--trainer.initialize_from_hf DIR` and no model flag (Llama through `loomax train`
    and `loomax export` in process, the others through what it calls), the hf_export hook's
    config.json differs from the imported one exactly in the fields its log line lists, and
    transformers' greedy continuation is ours (our argmax after each of its prefixes)."""
    source = tmp_path / "hf"
    imported = saved_by_transformers(torch, transformers, model_type, source)
    run = tmp_path / "run"
    args = ["--trainer.initialize_from_hf", str(source), "--trainer.run_dir", str(run), *data_args]
    with caplog.at_level(logging.INFO, logger="loomax.hf.convert"):
        if model_type == "llama":  # the commands themselves, once
            cli.main(["train", *args])
            assert "metrics:" in capsys.readouterr().out
            # the run's checkpoint keeps config.json too (model.hf_config_json in config.yaml)
            cli.main(["export", "--checkpoint", str(run / "checkpoints"), "--out", str(tmp_path / "x")])  # fmt: skip
        else:
            given = given_values(TrainLmConfig, None, args)
            config = parse_config(TrainLmConfig, None, hf_type_args(hf_source(given), given) + args)
            train_lm(with_hf_model(config, given))
    read = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model from")]
    assert f"model.type {model_type} (vocab_size {GOAL_VOCAB}, hidden_dim 32" in read[0]
    out = run / "hf" / f"step-{GOAL_STEPS}"
    [listed, *_] = [r.getMessage() for r in caplog.records if "the imported fields, changed" in r.getMessage()]  # fmt: skip
    changed = listed.rsplit("changed: ", 1)[1].split(", ")
    exported = json.loads((out / "config.json").read_text())
    differ = sorted(k for k in {*imported, *exported} if imported.get(k) != exported.get(k))
    assert differ == sorted(changed)  # unchanged but for the fields listed
    assert set(changed) <= {"bos_token_id", "eos_token_id"}  # the run's tokenizer's ids
    if model_type == "llama":
        assert json.loads((tmp_path / "x" / "config.json").read_text()) == exported
    before, after = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))  # fmt: skip
    assert before.keys() == after.keys()
    assert any(not np.array_equal(before[k], after[k]) for k in before)  # it trained
    ours, theirs = same_greedy_tokens(torch, transformers, families, out, [3, 1, 4, 1, 5])
    assert ours == theirs
