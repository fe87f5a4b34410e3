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


def test_configuration_page_lists_every_choice(repo_root):
    """docs/configuration.md's table of choices names every built-in type of every registry."""
    import re

    import loomax.callbacks  # noqa: F401  (registers the hook types)
    from loomax.config_reference import registry_members
    from loomax.ladder.model import ModelConfigurator
    from loomax.ladder.run import RunConfigurator
    from loomax.models import LmConfig, RotaryConfig
    from loomax.optim import OptimizerConfig
    from loomax.tracking import TrackerConfig
    from loomax.train.hook_config import HookConfig

    page = (repo_root / "docs" / "configuration.md").read_text()
    rows = {
        "`model.type`": LmConfig,
        "`model.rope.type`": RotaryConfig,
        "`optimizer.type`": OptimizerConfig,
        "`trainer.tracker.type`": TrackerConfig,
        "`trainer.hooks[].type`": HookConfig,
        "ladder `model.type`": ModelConfigurator,
        "ladder `run.type`": RunConfigurator,
    }
    for key, registry in rows.items():
        row = next((line for line in page.splitlines() if line.startswith(f"| {key}")), None)
        assert row is not None, f"docs/configuration.md has no row for {key}"
        listed = set(re.findall(r"`([a-z_0-9]+)`", row.split("|")[2]))
        assert listed == {name for name, _ in registry_members(registry)}, key
