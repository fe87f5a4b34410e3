"""Hugging Face export every N steps and at the end: ``<path>/step-<N>/`` in the HF layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)


@hook_type("hf_export")
class HfExportHook(Hook):
    """Writes the model as a Hugging Face checkpoint (``loomax.hf.export_hf``) every
    ``every`` steps and when training ends, into ``<path>/step-<N>`` (``path`` defaults to
    ``<run_dir>/hf``). Every process gathers the (possibly sharded) weights; only the
    ``primary`` one writes."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Writes Hugging Face checkpoints (safetensors + config.json + tokenizer) every N steps and at the end."""

        every: int = 1000
        """Export every this many steps (and once when training ends)."""
        path: str | None = None
        """Directory of the step-N exports; null = <run_dir>/hf."""

        def __post_init__(self):
            self.check_positive("every")

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        run_dir: str | Path | None = None,
        tokenizer: Any = None,
        special_tokens: dict[str, int] | None = None,
        primary: bool = True,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        if self.config.path is None and run_dir is None:
            raise ValueError("HfExportHook needs a path or a run_dir")
        self.path = Path(self.config.path) if self.config.path else Path(run_dir) / "hf"
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens or {}
        self.primary = primary
        self.last_step: int | None = None
        self.written: list[Path] = []

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        special = {}
        if context.tokenizer is not None:
            from loomax.hf import special_token_ids

            special = special_token_ids(context.tokenizer)
        return cls(
            config,
            run_dir=context.run_dir,
            tokenizer=context.tokenizer,
            special_tokens=special,
            primary=context.primary,
        )

    def on_step(self, info: StepInfo) -> None:
        self._export(info)

    def on_train_end(self, info: StepInfo) -> None:
        if self.last_step != info.step:
            self._export(info)

    def _export(self, info: StepInfo) -> None:
        from jax.experimental import multihost_utils

        from loomax.hf import export_hf

        model = info.state.model
        if jax.process_count() > 1:
            model = multihost_utils.process_allgather(model, tiled=True)
        self.last_step = info.step
        if not self.primary:
            return
        out = self.path / f"step-{info.step}"
        export_hf(model, out, tokenizer=self.tokenizer, special_tokens=self.special_tokens)
        self.written.append(out)
        logger.info("exported a Hugging Face checkpoint at step %d: %s", info.step, out)
