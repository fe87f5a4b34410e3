"""Issue 62's goal: a tiny Qwen3, Qwen3-MoE and Llama saved by transformers (built here from
a config, random weights, no Hub) continue training with `--trainer.initialize_from_hf DIR`
and no model flag, are exported by the hf_export hook, and give the same greedy tokens in
transformers as here (our argmax after each prefix of transformers' continuation), their
config.json unchanged but for the fields the export lists.

The Llama run goes through `loomax train` itself (cli.main, in process); the other two
through what it calls (lm.with_hf_model on the run's given keys, then train_lm). The token
cache and tokenizer are built once for the module, in this process (no Ray)."""

from __future__ import annotations

import json
import logging

import haliax as hax
import numpy as np
import pytest
from safetensors.numpy import load_file

from loomax import cli
from loomax.cli_parser import given_values
from loomax.config import parse_config
from loomax.hf import load_hf
from loomax.lm import TrainLmConfig, hf_source, hf_type_args, with_hf_model
from loomax.train_lm import train_lm

pytestmark = pytest.mark.slow

VOCAB = 300
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=32, bos_token_id=None,
    eos_token_id=None,
)  # fmt: skip
FAMILIES = {
    "llama": dict(intermediate_size=64),
    "qwen3": dict(intermediate_size=64),
    "qwen3_moe": dict(
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    ),  # fmt: skip
}
STEPS = 3


@pytest.fixture(scope="module")
def hf_modules():
    import torch
    import transformers

    return torch, transformers


@pytest.fixture(scope="module")
def data_args(tmp_path_factory, tiny_corpus):
    cache = tmp_path_factory.mktemp("cache")
    return [
        "--data.train", json.dumps([{"urls": [str(tiny_corpus)]}]),
        "--data.tokenizer_vocab_size", str(VOCAB), "--data.validation_fraction", "0.1",
        "--data.cache_dir", str(cache),
        "--trainer.train_batch_size", "4", "--trainer.num_train_steps", str(STEPS),
        "--trainer.eval_at_start", "false", "--trainer.max_eval_batches", "1",
        "--trainer.progress_bar", "false", "--trainer.mp", "f32",
        "--trainer.hooks", json.dumps([{"type": "hf_export", "every": 1000, "validate": False}]),
        "--optimizer.learning_rate", "0.01", "--optimizer.warmup", "0",
        "--sample.enabled", "false",
    ]  # fmt: skip


def saved_by_transformers(hf_modules, model_type, path):
    """A tiny model of ``model_type`` saved by transformers, its weights spread out (std 0.1)
    so that greedy decoding has clear winners."""
    torch, transformers = hf_modules
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **SHAPE, **FAMILIES[model_type])
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return json.loads((path / "config.json").read_text())


def same_greedy_tokens(hf_modules, path, prompt, n=8):
    """transformers' greedy continuation of ``prompt`` from the export at ``path``, and
    whether ours is the same: our argmax after each prefix of it, in one forward pass."""
    torch, transformers = hf_modules
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0].tolist()  # fmt: skip
    logits = load_hf(path).logits(hax.named(np.asarray(theirs), "position")).array
    ours = prompt + np.asarray(logits).argmax(-1)[len(prompt) - 1 : -1].tolist()
    return ours, theirs


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_transformers_checkpoint_continues_exports_and_decodes_alike(
    tmp_path, model_type, hf_modules, data_args, caplog, capsys
):
    source = tmp_path / "hf"
    imported = saved_by_transformers(hf_modules, model_type, source)
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
    assert f"model.type {model_type} (vocab_size {VOCAB}, hidden_dim 32" in read[0]
    out = run / "hf" / f"step-{STEPS}"
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
    ours, theirs = same_greedy_tokens(hf_modules, out, [3, 1, 4, 1, 5])
    assert ours == theirs
