"""Gradient dumps: at listed steps, the step's gradients written to safetensors.

The gradients are those the optimizer received in that step (of the mean loss over the
whole batch, after microbatch accumulation), taken inside the step by a ``JitHook``; the
host part gathers them from every process (``process_allgather``) and process 0 writes
``<run_dir>/gradients/step-<N>.safetensors``: one tensor per parameter, named by its path
(``blocks/stacked/mlp/up/weight``), in the parameter's own axis order (stacked layers
first), with the axis names and the step in the file's metadata.

Cost: the step returns the chosen gradients as a metric, replicated on every device, on
every step (zeros off the listed steps): memory the size of those gradients on each
device. On a large model choose the parameters with ``include``.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from loomax.atomic_files import replace_path
from loomax.config import ConfigError
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo
from loomax.train.step import JitHook, StepContext
from loomax.tree_paths import named_leaves

logger = logging.getLogger(__name__)


@hook_type("dump_gradients")
class DumpGradientsHook(Hook):
    """Writes the gradients of the listed steps (all parameters, or those ``include`` names)."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Write the gradients of the listed steps to <run_dir>/<directory>/step-<N>.safetensors."""

        steps: list[int] = field(default_factory=list)
        """Steps (counted from 1) whose gradients are written."""
        include: list[str] = field(default_factory=lambda: ["*"])
        """Glob patterns of the parameter paths written, e.g. [blocks/*/mlp/*]."""
        directory: str = "gradients"
        """Folder in the run directory the files go to."""

        def __post_init__(self):
            self.check(bool(self.steps), "steps must list at least one step, e.g. [100, 1000]")
            self.check(all(s > 0 for s in self.steps), f"steps must be > 0, got {self.steps}")
            self.check(bool(self.include), "include must hold at least one pattern")
            self.check(bool(self.directory), "directory must not be empty")

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        run_dir: str | Path,
        write: bool = True,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.every = reduce(math.gcd, self.config.steps)  # on_step sees every listed step
        self.out_dir = Path(run_dir) / self.config.directory
        self.write = write
        self._axes: dict[str, list[str]] = {}
        steps = jnp.asarray(sorted(set(self.config.steps)), jnp.int32)

        def chosen(context: StepContext) -> dict[str, jax.Array]:
            grads = self._chosen(context.grads)
            zeros = lambda: {k: jnp.zeros_like(v) for k, v in grads.items()}  # noqa: E731
            return jax.lax.cond(jnp.isin(context.step + 1, steps), lambda: grads, zeros)

        self._jit = JitHook(chosen, every=self.every)

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, run_dir=context.run_dir, write=context.primary)

    def jit_hooks(self) -> list[JitHook]:
        return [self._jit]

    def _chosen(self, grads: Any) -> dict[str, jax.Array]:
        """The gradients whose path matches ``include``, by path (their axis names noted)."""
        out = {}
        for name, leaf in named_leaves(grads):
            if not any(fnmatch.fnmatch(name, p) for p in self.config.include):
                continue
            if isinstance(leaf, hax.NamedArray):
                self._axes[name] = [a.name for a in leaf.axes]
                leaf = leaf.array
            out[name] = leaf
        return out

    def on_train_begin(self, info: StepInfo) -> None:
        names = [n for n, _ in named_leaves(eqx.filter(info.state.model, eqx.is_inexact_array))]
        if not any(fnmatch.fnmatch(n, p) for n in names for p in self.config.include):
            raise ConfigError(
                f"trainer.hooks (dump_gradients): include {self.config.include} matches no "
                f"parameter; they are named like {names[0]!r}"
            )

    def on_step(self, info: StepInfo) -> None:
        if info.step not in self.config.steps:
            return
        arrays = info.traced_outputs[id(self._jit)]
        host = {name: _gathered(array) for name, array in sorted(arrays.items())}
        if not self.write:
            return
        metadata = {"step": str(info.step), "axes": json.dumps(self._axes)}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"step-{info.step}.safetensors"
        replace_path(path, lambda tmp: save_file(host, str(tmp), metadata=metadata))
        logger.info("gradients of step %d (%d tensors) written to %s", info.step, len(host), path)


def _gathered(array: jax.Array) -> np.ndarray:
    """The whole of ``array`` on this host (a collective when it spans processes)."""
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(jax.device_get(array))
