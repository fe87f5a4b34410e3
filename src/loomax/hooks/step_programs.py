"""The step's programs as artifacts: its jaxpr and the optimized HLO XLA compiled it to.

After the first step (compiled by then), the hook traces the run's step again for the same
shapes and shardings (``HookContext.trace_step``, nothing run) and saves, through the
run's ``write_artifact`` (``<run_dir>/artifacts/`` and the tracker, process 0):

- ``train_step.jaxpr.txt``: the jaxpr (``log_jaxprs``);
- ``train_step.hlo.txt``: the optimized HLO of the compiled step (``log_xla_hlo``). Compiling
  again for it usually finds the step in JAX's compilation caches; else it is one more
  compile of the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from loomax.mesh import batch_sharding
from loomax.row_blocks import row_blocks
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

JAXPR_FILE = "train_step.jaxpr.txt"
HLO_FILE = "train_step.hlo.txt"


@hook_type("step_programs")
class StepProgramsHook(Hook):
    """Saves the step's jaxpr and optimized HLO once, after the first step of the run."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """The train step's jaxpr and optimized HLO saved as artifacts after the first step."""

        log_jaxprs: bool = True
        """Save the step's jaxpr as artifacts/train_step.jaxpr.txt."""
        log_xla_hlo: bool = True
        """Save the compiled step's optimized HLO as artifacts/train_step.hlo.txt."""

        def __post_init__(self):
            self.check(self.log_jaxprs or self.log_xla_hlo, "set log_jaxprs or log_xla_hlo")

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        trace_step: Callable[..., Any],
        write_artifact: Callable[..., Any],
        mesh: jax.sharding.Mesh,
        primary: bool = True,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.trace_step, self.write_artifact = trace_step, write_artifact
        self.mesh = mesh
        self.primary = primary
        self.written: list[str] = []
        self._state: Any = None
        self._batch: Any = None

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        if context.trace_step is None or context.write_artifact is None:
            raise ValueError(
                "trainer.hooks (step_programs) needs the run's trace_step and write_artifact"
            )
        return cls(
            config,
            trace_step=context.trace_step,
            write_artifact=context.write_artifact,
            mesh=context.runtime.mesh,
            primary=context.primary,
        )

    def on_train_begin(self, info: StepInfo) -> None:
        self._state = jax.tree.map(_shape, info.state)  # the state is donated to the first step

    def transform_batch(self, step: int, batch: Any) -> Any:
        if self._batch is None:  # the first batch's global shapes, as the step receives it
            self._batch = jax.tree.map(self._global_shape, batch)
        return batch

    def on_step(self, info: StepInfo) -> None:
        if self.written or self._state is None or self._batch is None or not self.primary:
            return
        traced = self.trace_step(self._state, self._batch)
        if self.config.log_jaxprs:
            self.write_artifact(JAXPR_FILE, str(traced.jaxpr), type="jaxpr")
            self.written.append(JAXPR_FILE)
        if self.config.log_xla_hlo:
            self.write_artifact(HLO_FILE, traced.lower().compile().as_text(), type="hlo")
            self.written.append(HLO_FILE)
        logger.info("the train step's programs saved: %s", ", ".join(self.written))
        self._state = self._batch = None

    def _global_shape(self, x: Any) -> jax.ShapeDtypeStruct:
        x = np.asarray(x)
        shape = (
            x.shape[0] * row_blocks(self.mesh.devices)[jax.process_index()].count,
            *x.shape[1:],
        )
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=batch_sharding(self.mesh, x.ndim))


def _shape(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
