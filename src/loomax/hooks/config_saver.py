"""Config saver: the full resolved run config as ``config.yaml`` in the run dir and every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loomax.atomic_files import replace_text
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo


@hook_type("config_saver")
class ConfigSaverHook(Hook):
    """Writes ``config_yaml`` to ``<run_dir>/config.yaml`` (if ``write``: process 0) and into each checkpoint."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """The resolved config as YAML in the run dir and every checkpoint (the run always adds one)."""

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        config_yaml: str,
        run_dir: str | Path,
        write: bool = True,
    ):
        super().__init__(config)
        self.config_yaml = config_yaml
        self.run_dir = Path(run_dir)
        self.write = write
        if write:  # before training, so a run that fails early still has it
            self.run_dir.mkdir(parents=True, exist_ok=True)
            replace_text(self.run_dir / "config.yaml", config_yaml)

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook | list[Hook]:
        if context.config_yaml is None:
            return []
        return cls(
            config, config_yaml=context.config_yaml, run_dir=context.run_dir, write=context.primary
        )

    def on_train_begin(self, info: StepInfo) -> None:
        if self.write and not (self.run_dir / "config.yaml").exists():
            replace_text(self.run_dir / "config.yaml", self.config_yaml)

    def checkpoint_files(self) -> dict[str, bytes]:
        return {"config.yaml": self.config_yaml.encode()}
