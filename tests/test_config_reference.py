"""The configuration reference is generated from the dataclasses and kept current."""

from __future__ import annotations

import pytest

from loomax.config_reference import field_docs, render, render_reference, undocumented
from loomax.dpo.config import TrainDpoConfig
from loomax.lm import TrainLmConfig
from loomax.models import Gpt2Config


def test_every_public_field_has_a_doc():
    assert undocumented(TrainLmConfig) == []
    assert undocumented(TrainDpoConfig) == []


def test_docs_come_from_the_string_below_each_field():
    docs = field_docs(Gpt2Config)
    assert docs["hidden_dim"].startswith("Width of the residual stream")
    assert docs["seq_len"].startswith("Tokens per training sequence")  # inherited from LmConfig


@pytest.fixture(scope="module")
def reference() -> str:
    """The whole generated reference (rendered once for the tests that read it)."""
    return render_reference()


def test_committed_reference_is_current(repo_root, reference):
    committed = (repo_root / "docs" / "reference" / "config.md").read_text()
    assert committed == reference, (
        "run `make docs` (python -m loomax.config_reference docs/reference/config.md)"
    )


def test_reference_lists_sections_and_choices(reference):
    text = render(TrainLmConfig)
    for heading in (
        "## `model` (`type: gpt2`)",
        "## `optimizer` (`type: adam`)",
        "## `trainer`",
        "## `trainer.tracker` (`type: noop`)",
    ):
        assert heading in text
    assert "| `num_train_steps` | `int` | `1000` |" in text
    assert "## `dpo`" in reference  # loomax dpo's own section


def test_configuration_page_lists_every_choice(repo_root):
    """docs/configuration.md's table of choices names every built-in type of every registry."""
    import re

    import loomax.hooks  # noqa: F401  (registers the hook types)
    from loomax.config_reference import registry_members
    from loomax.ladder.model import ModelConfigurator
    from loomax.ladder.run import RunConfigurator
    from loomax.models import RotaryConfig
    from loomax.tracking import TrackerConfig

    page = (repo_root / "docs" / "configuration.md").read_text()
    rows = {
        "`model.rope.type`": RotaryConfig,
        "`trainer.tracker.type`": TrackerConfig,
        "ladder `model.type`": ModelConfigurator,
        "ladder `run.type`": RunConfigurator,
    }
    for key, registry in rows.items():
        row = next((line for line in page.splitlines() if line.startswith(f"| {key}")), None)
        assert row is not None, f"docs/configuration.md has no row for {key}"
        listed = set(re.findall(r"`([a-z_0-9]+)`", row.split("|")[2]))
        assert listed == {name for name, _ in registry_members(registry)}, key


def _table(page: str, heading: str) -> dict[str, list[str]]:
    """The rows of the first table under ``heading``: first cell (a `name`) -> the other cells."""
    section = page.split(heading + "\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): [c.strip() for c in cells[1:]] for cells in rows}


def test_pages_list_every_family_optimizer_and_hook(repo_root):
    """configuration.md points to one table per registry that grows by a file (families,
    optimizers, hooks); each of those tables lists every built-in type of its registry."""
    import loomax.hooks  # noqa: F401  (registers the hook types)
    from loomax.config_reference import registry_members
    from loomax.models import LmConfig
    from loomax.optim import OptimizerConfig
    from loomax.train.hook_config import HookConfig

    docs = repo_root / "docs"
    config_page = (docs / "configuration.md").read_text()
    for key, page, heading, registry in [
        ("model.type", "models.md", "## Families", LmConfig),
        ("optimizer.type", "optimizers.md", "## Types", OptimizerConfig),
        ("trainer.hooks[].type", "hooks.md", "## Built-in hooks", HookConfig),
    ]:
        assert f"| `{key}` | one per " in config_page, key
        table = _table((docs / page).read_text(), heading)
        table.pop("type", None), table.pop("model.type", None)
        members = dict(registry_members(registry))
        if registry is HookConfig:  # the removed types that only say how to migrate
            members = {n: c for n, c in members.items() if c.hook_class is not None}
        assert set(table) == set(members), (page, set(table) ^ set(members))
        if registry is LmConfig:  # the transformers class of each family
            for name, cls in members.items():
                assert table[name][1].strip("`") == getattr(cls, "hf_architecture", "none")
