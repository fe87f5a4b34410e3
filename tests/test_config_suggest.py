"""A misspelled flag, YAML key or `type` is answered with the nearest valid name."""

from __future__ import annotations

import pytest

from loomax.cli_parser import load_config
from loomax.config import ConfigError, parse_config
from loomax.errors import UserError
from loomax.lm import TrainLmConfig


def test_each_misspelled_flag_names_the_nearest_flag():
    flags = [
        "--trainer.num_train_step",  # the example
        "5",
        "--modle.type",  # the section misspelled
        "llama",
        "--model.moe.num_expert=4",  # a field of some model.type
        "--zzzz",  # like no flag: no hint
        "1",
    ]
    with pytest.raises(UserError) as error:
        load_config(TrainLmConfig, None, flags)
    assert str(error.value) == (
        f"unrecognized arguments: {' '.join(flags)} (did you mean --trainer.num_train_steps "
        "and --model.type and --model.moe.num_experts?)"
    )


@pytest.mark.parametrize(
    "yaml_text, line, hint",
    [
        (
            "trainer:\n  seed: 1\n  num_train_step: 5\n",
            3,
            "did you mean `trainer.num_train_steps`?",
        ),
        ("trainr:\n  seed: 1\n", 1, "did you mean `trainer`?"),
        ("model:\n  type: gpt2\n  hiden_dim: 3\n", 3, "did you mean `model.hidden_dim`?"),
        (
            "model:\n  type: gtp2\n",
            1,
            "did you mean `gpt2`? model.type is one of: deepseek_v3, gemma2, gemma3_text, gpt2,",
        ),
        (
            "trainer:\n  hooks:\n    - {type: divergnce, patience: 3}\n",
            2,
            "did you mean `divergence`? trainer.hooks[0].type is one of: activations,",
        ),
    ],
)
def test_a_misspelled_yaml_key_or_type_names_the_nearest(tmp_path, yaml_text, line, hint):
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as error:
        parse_config(TrainLmConfig, path)
    assert hint in str(error.value)
    assert str(error.value).endswith(f"run.yaml, line {line})")
