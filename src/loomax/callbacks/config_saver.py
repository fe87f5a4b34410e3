"""Config saver: the full resolved run config as ``config.yaml`` in the run dir and every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loomax.train.hook_config import HookConfig, HookContext
from loomax.train.hooks import Hook, StepInfo


class ConfigSaverHook(Hook):
    """Writes ``config_yaml`` to ``<run_dir>/config.yaml`` (process 0) and into each checkpoint."""

    def __init__(self, config_yaml: str, run_dir: Path, *, write: bool = True):
        self.config_yaml = config_yaml
        self.run_dir = Path(run_dir)
        self.write = write
        if write:  # before training, so a run that fails early still has it
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(config_yaml)

    def on_train_begin(self, info: StepInfo) -> None:
        if self.write and not (self.run_dir / "config.yaml").exists():
            (self.run_dir / "config.yaml").write_text(self.config_yaml)

    def checkpoint_files(self) -> dict[str, bytes]:
        return {"config.yaml": self.config_yaml.encode()}


@HookConfig.register_subclass("config_saver")
@dataclass(frozen=True)
class ConfigSaverConfig(HookConfig):
    """The resolved config as YAML in the run dir and every checkpoint (the run always adds one)."""

    def build(self, context: HookContext) -> Hook | list:
        if context.config_yaml is None:
            return []
        return ConfigSaverHook(context.config_yaml, context.run_dir, write=context.primary)
