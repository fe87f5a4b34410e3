"""The trainer: jit the pure step once, run it in a loop, and run hooks around it.

Process setup (JAX settings, ``jax.distributed``, the shared run id) happens before, at
the entry point (``loomax.train.process.setup_process``); where the state comes from is
``loomax.train.restore``; placing arrays on the mesh is ``loomax.runtime.MeshRuntime``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import optax

from loomax.checkpoint import Checkpointer, CheckpointInfo
from loomax.config import ConfigError
from loomax.runtime import MeshRuntime
from loomax.tracking import Tracker, build_tracker, check_trackers
from loomax.tracking.artifacts import write_file
from loomax.train.config import TrainerConfig
from loomax.train.epochs import Epochs
from loomax.train.hook_set import HookSet
from loomax.train.hooks import FnHook, Hook, StepInfo
from loomax.train.loop import TrainingLoop
from loomax.train.process import check_accelerator, local_run_id, record_run_id
from loomax.train.restore import StateBuilder
from loomax.train.saving import checkpoint_payload
from loomax.train.state import TrainerState
from loomax.train.step import JitHook, LossFn
from loomax.train.step_fns import JittedSteps

logger = logging.getLogger(__name__)


class Trainer(TrainingLoop, JittedSteps):
    """Runs ``train_step`` in a loop with hooks.

    ``loss_fn(model, batch, *, key) -> (loss_sum, weight)`` (or ``((loss_sum, weight),
    metrics)``, see ``loomax.train.loss_metrics``) defines the objective; ``optimizer`` is
    any optax transformation. ``epoch_size`` (sequences in one pass over the data) turns on
    epoch events and lets ``trainer.num_train_epochs`` set the number of steps;
    ``qk_clip_tau`` turns on QK-clip after each update (``loomax.optim.qk_clip``). Hooks are added with ``add_hook`` (also as
    a decorator) and run on the host, by priority then registration order, after the
    steps they are due.

    The state lives on ``trainer.runtime.mesh`` (from ``config.mesh``, over ``devices`` or
    all of them), laid out by the parameter mapping; the step computes under the compute
    mapping. In a multi-process run call ``setup_process(config)`` first and pass its
    ``run_id``. Under ``trainer.diloco`` the optimizer is each worker's inner optimizer.
    """

    def __init__(
        self,
        config: TrainerConfig,
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn,
        *,
        lr_schedule: optax.Schedule | None = None,
        run_dir: str | Path | None = None,
        run_id: str | None = None,
        devices: Sequence[jax.Device] | None = None,
        outer_optimizer: optax.GradientTransformation | None = None,
        epoch_size: int | None = None,
        qk_clip_tau: float | None = None,
    ):
        check_accelerator(config)
        config = config.with_epoch_size(epoch_size)  # trainer.num_train_epochs -> steps
        self.config = config
        self.optimizer = optimizer
        self.outer_optimizer = outer_optimizer
        """Under ``trainer.diloco``: the outer optimizer (any optax transformation of the
        pseudo-gradient); None = the config's Nesterov SGD."""
        self.loss_fn = loss_fn
        self.qk_clip_tau = qk_clip_tau
        """QK-clip's threshold (``optimizer.qk_clip_tau``; ``loomax.optim.qk_clip``), or None."""
        self.lr_schedule = lr_schedule
        self.runtime = MeshRuntime.create(
            config.mesh, config.axis_mappings(), devices, config.pipeline
        )
        chosen_dir = run_dir or config.run_dir
        self.run_id = run_id or config.run_id or local_run_id(chosen_dir)
        self.run_dir = config.run_path(self.run_id, run_dir)
        self._records_run_id = chosen_dir is not None
        """A run dir given (not ``runs/<run_id>``) records the run id, for a rerun to reuse."""
        self.batch_schedule = config.batch_schedule
        self.epochs = Epochs(epoch_size, self.batch_schedule) if epoch_size else None
        """Epoch boundaries (``epoch_size`` sequences make an epoch), or None when unknown."""
        dp = self.runtime.data_parallel_size
        self.num_microbatches = config.microbatches(dp)
        for size in self.batch_schedule.sizes:  # every stage must split over the devices
            config.microbatches(dp, size)
            if size % dp and jax.process_count() > 1:
                raise ConfigError(
                    f"trainer.allow_nondivisible_batch_size: a batch of {size} that does not "
                    f"divide over {dp} devices needs a run of one process"
                )
        self.hook_set = HookSet()
        self._state_made = False
        self._tracker: Tracker | None = None
        self._step_fns: dict[int, Callable] = {}
        """The jitted step per number of microbatches (each batch size may need its own)."""
        self._precompiled: dict[tuple, tuple[Any, list]] = {}
        """Steps compiled ahead of time (``precompile``) and their batch shapes, run in place
        of the jitted ones on batches of those shapes."""
        base_path = config.checkpoint_path(self.run_id, run_dir)
        self.checkpointer = Checkpointer(config.checkpointer, base_path, run_id=self.run_id)
        self.checkpointer.check_writable()  # a clear error now, not at the first save
        check_trackers(config.tracker)  # likewise a tracker whose package is missing
        self.run_config: dict[str, Any] | None = None
        """The whole run's config (JSON), stored in each checkpoint's metadata."""
        self.restored_from: CheckpointInfo | None = None
        """The checkpoint ``initial_state`` resumed from, if any."""
        self.stop_reason: str | None = None
        """Why ``train`` stopped before ``num_train_steps`` (a signal, the time limit), if it did."""
        self._restored_hook_states: dict[str, Any] = {}
        self._train_seconds = 0.0
        self._started = self._last_done = time.perf_counter()

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The device mesh the state lives on."""
        return self.runtime.mesh

    # ------------------------------------------------------------------ hooks
    def add_hook(
        self,
        fn: Callable[[StepInfo], Any] | Hook | JitHook | None = None,
        *,
        every: int = 1,
        priority: int = 0,
    ):
        """Run ``fn(info)`` after every ``every``-th step; usable as ``@trainer.add_hook(every=N)``.

        ``fn`` may also be a ``Hook`` (keeps its own ``every`` and ``priority``) or a
        ``JitHook``, whose outputs whoever holds it reads with ``info.traced(jit_hook)``.
        Hooks that change the step (``wrap_optimizer``, ``jit_hooks``, ``state_extras``)
        must be added before ``initial_state``.
        """
        if fn is None:
            return lambda f: self.add_hook(f, every=every, priority=priority)
        compiled = bool(self._step_fns)
        if isinstance(fn, JitHook):
            self.hook_set.add_jit_hooks([fn], "JitHooks", compiled=compiled)
            return fn
        hook = fn if isinstance(fn, Hook) else FnHook(fn, every, priority)
        self.optimizer = self.hook_set.add(
            hook, self.optimizer, state_made=self._state_made, compiled=compiled
        )
        return fn

    @property
    def hooks(self) -> list[Hook]:
        """The hooks in running order."""
        return self.hook_set.hooks

    @property
    def tracker(self) -> Tracker:
        """The run's tracker (created on first use, in the run directory)."""
        if self._tracker is None:
            self._tracker = build_tracker(self.config.tracker, self.run_dir)
        return self._tracker

    # ------------------------------------------------------------------ state
    def initial_state(
        self,
        init_model: Callable[[jax.Array], eqx.Module],
        *,
        initial_weights: Callable[[], eqx.Module] | None = None,
    ) -> TrainerState:
        """The state to train from: resumed, initialized from other weights, or fresh from
        ``init_model(key)`` (the order is ``loomax.train.restore``'s); sharded on the mesh."""
        self._state_made = True
        builder = StateBuilder(
            self.config, self.runtime, self._state_optimizer(), self.hook_set.extras
        )
        restored = builder.restore(init_model, self.checkpointer, initial_weights)
        if self._records_run_id and jax.process_index() == 0:  # this run trains there now
            record_run_id(self.run_dir, self.run_id)
        self.restored_from = restored.checkpoint
        self._restored_hook_states = restored.hook_states
        self._train_seconds = restored.train_seconds
        if restored.checkpoint is not None:  # what was logged after it is superseded
            self.tracker.resume_from(restored.checkpoint.step)
        return restored.state

    def abstract_state(self, init_model: Callable[[jax.Array], eqx.Module]) -> TrainerState:
        """The fresh state ``initial_state`` would make, as sharded ``jax.ShapeDtypeStruct``s
        (nothing allocated, no checkpoint read): for compiling ahead of time."""
        self._state_made = True
        builder = StateBuilder(
            self.config, self.runtime, self._state_optimizer(), self.hook_set.extras
        )
        return builder.abstract(init_model)

    def _state_optimizer(self):
        """What makes ``opt_state`` from the parameters: the optimizer, or DiLoCo over it."""
        return self.diloco() or self.optimizer

    # ------------------------------------------------------------------ saving
    def _save(self, info: StepInfo, *, permanent: bool) -> None:
        state, metadata = checkpoint_payload(
            self.config,
            info.state,
            info.step,
            run_config=self.run_config,
            hooks=self.hook_set.states(),
            train_seconds=self._train_seconds + time.perf_counter() - self._started,
            mesh=dict(self.mesh.shape),
        )
        pinned = info.step == 0 and self.config.checkpointer.save_at_start
        files = self.hook_set.checkpoint_files()
        if self.checkpointer.save(
            info.step, state, metadata, permanent=permanent, pinned=pinned, files=files
        ):
            url = self.checkpointer.directory.child(f"step-{info.step}").url
            self.hook_set.call("on_save", info, url)

    def write_artifact(self, name: str, obj: Any, *, type: str = "artifact") -> Path:
        """Save ``obj`` as ``<run_dir>/artifacts/<name>`` and log it to the tracker (process 0).

        ``str`` and ``bytes`` are written as they are, an existing ``Path`` is copied, anything
        else is written as JSON. Returns the path (on every process).
        """
        path = self.run_dir / "artifacts" / name
        if jax.process_index() == 0:
            write_file(path, obj)
            self.tracker.log_artifact(path, name=name, type=type)
        return path

    def finish(self) -> None:
        """Wait for the checkpoint in flight and close the tracker."""
        self.checkpointer.wait()
        if self._tracker is not None:
            self._tracker.finish()
