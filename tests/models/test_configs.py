"""The Llama configs under config/ parse, and the 8B one has Llama 3.1 8B's exact size."""

from __future__ import annotations

import pytest

from loomax.config import parse_config
from loomax.lm import TrainLmConfig
from loomax.models import LlamaConfig


@pytest.mark.parametrize("name", ["llama_tiny", "llama_150m", "llama_1b", "llama_8b"])
def test_llama_configs_parse(repo_root, name):
    config = parse_config(TrainLmConfig, repo_root / "config" / f"{name}.yaml")
    assert isinstance(config.model, LlamaConfig)


def test_llama_8b_parameter_count(repo_root):
    model = parse_config(TrainLmConfig, repo_root / "config" / "llama_8b.yaml").model
    assert model.param_count(model.vocab_size) == 8_030_261_248
