"""Hugging Face export every N steps and at the end: ``<path>/step-<N>/`` in the HF layout.

The weights are written in ``dtype`` (default: the parameters' own) and, with ``validate``,
read back with ``loomax.hf.load_hf`` and compared with what was meant to be written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


class ExportMismatchError(RuntimeError):
    """A Hugging Face export read back does not hold the weights that were written."""


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
        """Export every this many steps (and once when training ends, if at_end)."""
        at_end: bool = True
        """Also export when training ends."""
        path: str | None = None
        """Directory of the step-N exports; null = <run_dir>/hf."""
        dtype: str | None = None
        """Weights written as float32, bfloat16 or float16; null = the parameters' dtype."""
        validate: bool = True
        """Read each export back (loomax.hf.load_hf) and check it holds the weights written."""

        def __post_init__(self):
            self.check_positive("every")
            self.check(
                self.dtype in (None, *DTYPES),
                f"dtype must be one of {DTYPES} or null, got {self.dtype!r}",
            )

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
        if self.config.at_end and self.last_step != info.step:
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
        if self.config.dtype is not None:
            dtype = jnp.dtype(self.config.dtype)
            cast = lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x  # noqa: E731
            model = jax.tree.map(cast, model)
        out = self.path / f"step-{info.step}"
        export_hf(model, out, tokenizer=self.tokenizer, special_tokens=self.special_tokens)
        if self.config.validate:
            _check_reload(model, out)
        self.written.append(out)
        logger.info("exported a Hugging Face checkpoint at step %d: %s", info.step, out)


def _check_reload(model: Any, out: Path) -> None:
    """Raise ``ExportMismatchError`` unless ``out`` loads back as ``model``'s weights, bit for bit
    (``load_hf`` gives the model's own parameter dtype: compared in the dtype written)."""
    from loomax.hf import load_hf

    loaded = load_hf(out, model.config)
    written = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    read = jax.tree.leaves(eqx.filter(loaded, eqx.is_inexact_array))
    if len(written) != len(read):
        raise ExportMismatchError(f"{out}: {len(read)} arrays read back, {len(written)} written")
    for a, b in zip(written, read, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or not np.array_equal(a, b.astype(a.dtype)):
            raise ExportMismatchError(
                f"{out}: a weight read back differs from the one written "
                f"({b.dtype}{list(b.shape)} vs {a.dtype}{list(a.shape)})"
            )
