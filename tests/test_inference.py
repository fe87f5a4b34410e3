"""loomax.inference on a Hugging Face folder (`loomax generate|eval --checkpoint DIR`): the
model of its config.json, the run's --model.* flags winning, parsed with config.json's
family (a flag of that family's only parses), a disagreeing key refused naming both names."""

from __future__ import annotations

import logging

import jax
import pytest

from loomax.errors import BadFileError
from loomax.hf import export_hf
from loomax.inference import load_for_inference
from loomax.models.families.qwen3 import Qwen3Config

QWEN3 = Qwen3Config(
    seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
)


def test_an_hf_folder_is_read_from_config_json_and_the_flags_win(tmp_path, caplog):
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "<|endoftext|>": 1}, unk_token="a"))
    export_hf(QWEN3.build(97, key=jax.random.PRNGKey(0)), tmp_path, tokenizer=tokenizer)
    flags = [
        "--model.attn_backend",
        "vanilla",
        "--model.seq_len",
        "16",
        "--model.num_kv_heads",
        "2",
    ]
    with caplog.at_level(logging.INFO, logger="loomax.hf.convert"):
        loaded = load_for_inference(tmp_path, overrides=flags)
    config = loaded.model.config
    assert type(config) is Qwen3Config and config.hf_config(97) == {**QWEN3.hf_config(97), "max_position_embeddings": 16}  # fmt: skip
    assert (config.attn_backend, config.seq_len) == ("vanilla", 16)
    assert loaded.run_config.model == config  # eval's loss settings are the model's
    assert any("model.type qwen3 (vocab_size 97" in r.getMessage() for r in caplog.records)
    assert type(load_for_inference(tmp_path).model.config) is Qwen3Config  # no flags at all
    with pytest.raises(
        BadFileError,
        match=r"num_hidden_layers \(model.num_layers\): 2 in config.json, 3 configured",
    ):
        load_for_inference(tmp_path, overrides=["--model.num_layers", "3"])
