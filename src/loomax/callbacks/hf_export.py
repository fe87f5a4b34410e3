"""Hugging Face export every N steps and at the end: ``<path>/step-<N>/`` in the HF layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from loomax.train.hook_config import HookConfig, HookContext, check_positive
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)


class HfExportHook(Hook):
    """Writes the model as a Hugging Face checkpoint (``loomax.hf.export_hf``) every
    ``every`` steps and when training ends. Every process gathers the (possibly sharded)
    weights; only the ``primary`` one writes."""

    def __init__(
        self,
        every: int,
        path: str | Path,
        *,
        tokenizer: Any = None,
        special_tokens: dict[str, int] | None = None,
        primary: bool = True,
    ):
        self.every = every
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens or {}
        self.primary = primary
        self.last_step: int | None = None
        self.written: list[Path] = []

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


@HookConfig.register_subclass("hf_export")
@dataclass(frozen=True)
class HfExportConfig(HookConfig):
    """Writes Hugging Face checkpoints (safetensors + config.json + tokenizer) every N steps and at the end."""

    every: int = 1000
    """Export every this many steps (and once when training ends)."""
    path: str | None = None
    """Directory of the step-N exports; null = <run_dir>/hf."""

    def __post_init__(self):
        check_positive(self, "every")

    def build(self, context: HookContext) -> Hook:
        special = {}
        if context.tokenizer is not None:
            from loomax.hf import special_token_ids

            special = special_token_ids(context.tokenizer)
        return HfExportHook(
            self.every,
            self.path or Path(context.run_dir) / "hf",
            tokenizer=context.tokenizer,
            special_tokens=special,
            primary=context.primary,
        )
