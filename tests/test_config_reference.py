"""The configuration reference is generated from the dataclasses and kept current."""

from __future__ import annotations

from loomax.config_reference import field_docs, render, undocumented
from loomax.lm import TrainLmConfig
from loomax.models import Gpt2Config


def test_every_public_field_has_a_doc():
    assert undocumented(TrainLmConfig) == []


def test_docs_come_from_the_string_below_each_field():
    docs = field_docs(Gpt2Config)
    assert docs["hidden_dim"].startswith("Width of the residual stream")
    assert docs["seq_len"].startswith("Tokens per training sequence")  # inherited from LmConfig


def test_committed_reference_is_current(repo_root):
    committed = (repo_root / "docs" / "reference" / "config.md").read_text()
    assert committed == render(TrainLmConfig), (
        "run `make docs` (python -m loomax.config_reference docs/reference/config.md)"
    )


def test_reference_lists_sections_and_choices():
    text = render(TrainLmConfig)
    for heading in (
        "## `model` (`type: gpt2`)",
        "## `optimizer` (`type: adam`)",
        "## `trainer`",
        "## `trainer.tracker` (`type: noop`)",
    ):
        assert heading in text
    assert "| `num_train_steps` | `int` | `1000` |" in text
