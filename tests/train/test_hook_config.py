"""`trainer.hooks` entries: a hook from the user's own module, named `module:Class` in YAML."""

from __future__ import annotations

import sys
import uuid

import pytest

from loomax.config import ConfigError, parse_config, to_yaml
from loomax.lm import TrainLmConfig
from loomax.train import HookContext

HOOK_MODULE = '''
from dataclasses import dataclass

from loomax.train import Hook, HookConfig


class WriteSteps(Hook):
    """Appends each step it sees to a file."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        every: int = 1
        """Steps between writes."""
        path: str = "steps.txt"
        """The file to append to."""

    def on_step(self, info):
        with open(self.config.path, "a") as f:
            f.write(f"{info.step}\\n")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A hook module in a tmp dir, the current directory, which is not on ``sys.path``."""
    name = f"my_hooks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(HOOK_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    return name


def test_a_hook_from_the_users_module_is_named_in_yaml_and_runs(tmp_path, user_module, tiny):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"trainer:\n  hooks:\n    - {{type: '{user_module}:WriteSteps', every: 2, path: out.txt}}\n"
    )
    config = parse_config(TrainLmConfig, path)
    (hook_config,) = config.trainer.hooks
    assert hook_config.type_name() == f"{user_module}:WriteSteps"
    assert (hook_config.every, hook_config.path) == (2, "out.txt")
    saved = tmp_path / "saved.yaml"  # the run's config.yaml reads back with the same type
    saved.write_text(to_yaml(config))
    assert parse_config(TrainLmConfig, saved).trainer.hooks == config.trainer.hooks

    trainer = tiny.trainer(tmp_path, steps=4)
    trainer.add_hook(hook_config.build(HookContext(trainer.runtime)))
    trainer.train(tiny.init(trainer), tiny.batches())
    assert (tmp_path / "out.txt").read_text() == "2\n4\n"


@pytest.mark.parametrize(
    "hook_type, message",
    [
        ("no_such_module_x:Hook", "cannot import module 'no_such_module_x'"),
        ("{module}:Missing", "module '{module}' ({path}) has no class 'Missing'"),
    ],
)
def test_a_hook_module_or_class_that_is_not_there_is_one_line(
    tmp_path, user_module, hook_type, message
):
    hook_type = hook_type.format(module=user_module)
    message = message.format(module=user_module, path=tmp_path / f"{user_module}.py")
    with pytest.raises(ConfigError) as error:
        parse_config(TrainLmConfig, None, ["--trainer.hooks", f'[{{"type": "{hook_type}"}}]'])
    assert str(error.value).startswith(f"trainer.hooks: type '{hook_type}': {message}")
    assert "\n" not in str(error.value)
