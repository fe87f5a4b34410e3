"""config.json and the model section (loomax.hf.config_json): a run's model is read from a
checkpoint's config.json with the run's own keys winning, a disagreeing architecture key is
refused naming the HF field and the model key, export writes the imported config.json back
changed only where training changed it, and every family's fields are in its table and the
docs. No model is built and no weights are read here (a placeholder safetensors file)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest

from loomax import cli
from loomax.cli_parser import given_values
from loomax.config import parse_config
from loomax.hf.config_json import BOOKKEEPING, model_from_hf, written_config
from loomax.hf.family import families as hf_families
from loomax.lm import TrainLmConfig, hf_source, hf_type_args, with_hf_model
from loomax.models.attention.rotary import DefaultRotary
from loomax.models.families.gemma2 import Gemma2Config

DOCS = Path(__file__).parents[2] / "docs" / "models.md"

QWEN3_MOE = {  # a tiny Qwen3MoeConfig as transformers 5.24 saves it
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": None, "decoder_sparse_step": 1, "dtype": "float32", "eos_token_id": None,
    "head_dim": 8, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 512, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 32, "norm_topk_prob": True,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": False,
    "pad_token_id": None, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "transformers_version": "5.24.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 300,
}  # fmt: skip


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    (tmp_path / "model.safetensors").write_bytes(b"")  # present; never read here
    return tmp_path


def run_config(args: list[str]) -> TrainLmConfig:
    """What `loomax train` does with its flags before training (cli._train)."""
    given = given_values(TrainLmConfig, None, args)
    config = parse_config(TrainLmConfig, None, hf_type_args(hf_source(given), given) + args)
    return with_hf_model(config, given)


def test_every_config_json_field_has_its_model_key_and_a_docs_row(families):
    docs = DOCS.read_text().split("### Hugging Face config fields", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(\w+)`", "\n".join(r.split("|")[1] for r in docs.splitlines() if r.startswith("| `"))))  # fmt: skip
    for kind, cls in hf_families().items():
        written = set(families.tiny_config(kind).hf_config(97)) - set(BOOKKEEPING)
        assert written <= set(cls.hf_field_names), (kind, written - set(cls.hf_field_names))
        assert set(cls.hf_field_names) <= documented, (kind, set(cls.hf_field_names) - documented)


def test_the_model_comes_from_config_json_and_the_runs_own_keys_win(checkpoint, caplog):
    args = ["--trainer.initialize_from_hf", str(checkpoint)]
    with caplog.at_level(logging.INFO, logger="loomax.hf.convert"):
        model = run_config(
            [*args, "--model.seq_len", "16", "--model.attn_backend", "vanilla"]
        ).model
    assert type(model).__name__ == "Qwen3MoeConfig"
    assert (model.hidden_dim, model.intermediate_dim, model.num_kv_heads, model.head_dim) == (32, 32, 2, 8)  # fmt: skip
    assert (model.moe.num_experts, model.moe.num_experts_per_tok) == (4, 2)
    assert model.moe.norm_topk_prob is True  # config.json's, not the family default (false)
    assert model.moe.load_balance_loss_weight == pytest.approx(0.001 * 2)
    assert (model.seq_len, model.attn_backend, model.vocab_size) == (16, "vanilla", 300)
    assert model.hf_config_json == QWEN3_MOE
    [line] = [r.getMessage() for r in caplog.records if "model from" in r.getMessage()]
    assert "model.type qwen3_moe (vocab_size 300, hidden_dim 32" in line
    assert line.endswith("the run's own: attn_backend, seq_len")
    plain = run_config(args).model  # no model key at all: config.json's context length
    assert (plain.seq_len, plain.attn_backend) == (512, "auto")
    del QWEN3_MOE["norm_topk_prob"]
    try:
        (checkpoint / "config.json").write_text(json.dumps(QWEN3_MOE))
        assert run_config(args).model.moe.norm_topk_prob is False  # Qwen3-MoE's default
    finally:
        QWEN3_MOE["norm_topk_prob"] = True


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.hidden_dim", "64"], r"hidden_size \(model.hidden_dim\): 32 in config.json, 64 configured"),
        (["--model.type", "qwen3_moe", "--model.intermediate_dim", "128"],
         r"\(moe_intermediate_size \(model.intermediate_dim\): 32 in config.json, 128 configured\)$"),
        (["--model.moe.norm_topk_prob", "false"], r"norm_topk_prob \(model.moe.norm_topk_prob\): True in config.json, False configured"),
        (["--model.type", "llama"], r"holds model.type qwen3_moe .*, the run sets model.type llama; leave model.type out"),
    ],
    ids=["hidden_dim", "expert-width", "norm_topk_prob", "model.type"],
)  # fmt: skip
def test_a_key_that_disagrees_is_one_line_naming_both_names(checkpoint, capsys, flags, message):
    args = ["train", "--trainer.initialize_from_hf", str(checkpoint), *flags]
    with pytest.raises(SystemExit) as exit:
        cli.main(args)
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and "\n" not in err, err
    assert err.startswith("loomax train: error: trainer.initialize_from_hf: ")
    assert re.search(message, err), err


def test_export_writes_back_the_imported_config_json(checkpoint):
    model = run_config(["--trainer.initialize_from_hf", str(checkpoint), "--model.seq_len", "16"]).model  # fmt: skip
    out, changed = written_config(model, 300, {"torch_dtype": "float32"})
    assert (out, changed) == (QWEN3_MOE, [])  # max_position_embeddings, intermediate_size kept
    out, changed = written_config(model, 300, {"torch_dtype": "bfloat16", "eos_token_id": 5})
    assert changed == ["dtype", "eos_token_id"]
    assert out == {**QWEN3_MOE, "dtype": "bfloat16", "eos_token_id": 5}
    rope = dataclasses.replace(model, rope=DefaultRotary(theta=500000.0))  # what a run cannot
    out, changed = written_config(rope, 300)
    assert changed == ["rope_theta", "rope_parameters"]  # the same key, imported in a new form
    assert (out["rope_theta"], "rope_parameters" in out) == (500000.0, False)
    assert written_config(model_from_hf(QWEN3_MOE), 300)[0] == {**QWEN3_MOE}
    wider = dataclasses.replace(model, intermediate_dim=48)  # what a run cannot either
    out, changed = written_config(wider, 300)
    assert changed == ["moe_intermediate_size"] and out["intermediate_size"] == 128  # unread
    fresh, changed = written_config(dataclasses.replace(model, hf_config_json=None), 300)
    assert changed == [] and fresh["max_position_embeddings"] == 16  # no import: its own


def test_fields_keep_the_types_transformers_declares():
    gemma = Gemma2Config(query_pre_attn_scalar=256.0, num_layers=2)  # a float from Python
    value = gemma.hf_config(97)["query_pre_attn_scalar"]
    assert (value, type(value)) == (256, int)
    with pytest.raises(ValueError, match="query_pre_attn_scalar must be a positive whole"):
        Gemma2Config(query_pre_attn_scalar=100.5)
    base = {**gemma.hf_config(97), "rms_norm_eps": 1e-06}
    wider = dataclasses.replace(gemma, hf_config_json=base, rms_norm_eps=1e-5)
    out, changed = written_config(wider, 97)
    assert changed == ["rms_norm_eps"] and type(out["rms_norm_eps"]) is float


def test_phi3_export_refuses_a_rope_scaling_transformers_refuses(families):
    from loomax.models.attention.rotary import LinearRotary

    phi3 = families.tiny_config("phi3", rope=LinearRotary(factor=2.0))
    with pytest.raises(ValueError, match="Phi3ForCausalLM .* model.rope.type: default"):
        written_config(phi3, 97)


def test_a_tokenizer_larger_than_the_checkpoints_vocabulary_says_to_use_its_own(checkpoint):
    from loomax.lm import resolve_vocab_size

    model = run_config(["--trainer.initialize_from_hf", str(checkpoint)]).model
    assert resolve_vocab_size(model, 280) == 300  # a smaller tokenizer fits
    with pytest.raises(ValueError, match=r"\(300, the Hugging Face checkpoint's vocab_size\) .*data.tokenizer: its directory"):  # fmt: skip
        resolve_vocab_size(model, 8192)
