"""The trainer: jit the pure step once, run it in a loop, and run hooks around it.

Process setup (JAX settings, ``jax.distributed``, the shared run id) happens before, at
the entry point (``loomax.train.process.setup_process``); where the state comes from is
``loomax.train.restore``; placing arrays on the mesh is ``loomax.runtime.MeshRuntime``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import optax

from loomax.checkpoint import Checkpointer, CheckpointInfo
from loomax.runtime import MeshRuntime
from loomax.tracking import Tracker, build_tracker, check_trackers
from loomax.tracking.artifacts import write_file
from loomax.train.config import TrainerConfig
from loomax.train.control import Control, Decision, StepAgreement, StopSignals
from loomax.train.hook_set import HookSet
from loomax.train.hooks import CompletedStep, FnHook, Hook, StepInfo
from loomax.train.process import local_run_id
from loomax.train.restore import StateBuilder
from loomax.train.saving import checkpoint_payload, saves_at_start
from loomax.train.state import TrainerState
from loomax.train.step import TRACED, JitHook, LossFn
from loomax.train.step_fns import JittedSteps

logger = logging.getLogger(__name__)


class Trainer(JittedSteps):
    """Runs ``train_step`` in a loop with hooks.

    ``loss_fn(model, batch, *, key) -> (loss_sum, weight)`` defines the objective;
    ``optimizer`` is any optax transformation. Hooks are added with ``add_hook`` (also as
    a decorator) and run on the host, by priority then registration order, after the
    steps they are due.

    The state lives on ``trainer.runtime.mesh`` (from ``config.mesh``, over ``devices`` or
    all of them), laid out by the parameter mapping; the step computes under the compute
    mapping. In a multi-process run call ``setup_process(config)`` first and pass its
    ``run_id``.
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
    ):
        self.config = config
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.lr_schedule = lr_schedule
        self.runtime = MeshRuntime.create(config.mesh, config.axis_mappings(), devices)
        self.run_id = run_id or config.run_id or local_run_id()
        self.run_dir = Path(run_dir or config.run_dir or Path("runs") / self.run_id)
        self.batch_schedule = config.batch_schedule
        dp = self.runtime.data_parallel_size
        self.num_microbatches = config.microbatches(dp)
        for size in self.batch_schedule.sizes:  # every stage must split over the devices
            config.microbatches(dp, size)
        self.hook_set = HookSet()
        self._state_made = False
        self._tracker: Tracker | None = None
        self._step_fns: dict[int, Callable] = {}
        """The jitted step per number of microbatches (each batch size may need its own)."""
        base_path = config.checkpointer.base_path or str(self.run_dir / "checkpoints")
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
        builder = StateBuilder(self.config, self.runtime, self.optimizer, self.hook_set.extras)
        restored = builder.restore(init_model, self.checkpointer, initial_weights)
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
        builder = StateBuilder(self.config, self.runtime, self.optimizer, self.hook_set.extras)
        return builder.abstract(init_model)

    # ------------------------------------------------------------------ loop
    def train(self, state: TrainerState, batches: Iterator[Any] | Sequence[Any]) -> StepInfo:
        """Train from ``state`` to ``num_train_steps`` on ``batches``; returns the final ``StepInfo``.

        Step k+1 is dispatched before the host waits for step k, so the device never idles
        on the host; only hooks that read this step's values (at their intervals) wait.
        After each step's hooks the trainer takes a ``Decision`` (eval, then save, then
        stop) from what they asked through ``info.control``, the checkpointer's policies,
        signals and ``max_train_time``; every process takes process 0's decision.
        """
        batches = iter(batches)
        control = Control()
        info = self._step_info(int(state.step), state, {}, control)
        if not self.config.eval_only:  # an eval-only job evaluates afresh, whatever hooks did
            self.hook_set.load_states(self._restored_hook_states)
        self._restored_hook_states = {}
        pending: tuple[int, dict] | None = None
        previous: CompletedStep | None = None
        self._started = self._last_done = time.perf_counter()
        agreement, signals = StepAgreement(), StopSignals()
        self.stop_reason = None
        try:
            with signals.installed():
                if self.config.eval_only:
                    self._eval_only(info, control)
                    return info
                self.hook_set.call("on_train_begin", info)
                at_start = saves_at_start(self.config, info.step, self.restored_from is not None)
                start_save = "permanent" if at_start else None
                self._act(info, Decision(eval=control.eval_requested, save=start_save))
                control.clear()
                for step in range(info.step + 1, self.config.num_train_steps + 1):
                    batch = self.hook_set.transform_batch(step, next(batches))
                    dispatched_at = time.perf_counter()
                    state, metrics = self.train_step(state, batch, **self._batch_size_args(step))
                    if pending is not None:  # the step before is done: its values are on the host
                        previous = self._complete(*pending)
                    self._flush(info)  # the record of the step before, now that this one is queued
                    info = self._step_info(step, state, metrics, control, previous, dispatched_at)
                    self.hook_set.call("on_step", info)
                    pending = (step, info.metrics)
                    decision = agreement.agree(step, self._propose(step, control, signals))
                    control.clear()
                    self._act(info, decision)
                    self.checkpointer.raise_if_failed()  # a failed save stops the run at once
                    if decision.stop:
                        self.stop_reason = decision.stop
                        logger.warning("stopping at step %d: %s", step, self.stop_reason)
                        break
                if pending is not None:
                    info.previous = self._complete(*pending)
                self.hook_set.call("on_train_end", info)
                self._act(info, self._final_decision(info.step, control))
                control.clear()
                self.checkpointer.wait()
        except BaseException as error:
            self.hook_set.on_error(info, error)
            raise
        finally:
            self._flush(info)
            try:
                self.checkpointer.wait()  # let a save in flight commit, even after an error
            except Exception:  # noqa: BLE001 - the original error matters more
                logger.exception("checkpoint save failed")
        return info

    def _eval_only(self, info: StepInfo, control: Control) -> None:
        """``trainer.eval_only``: one evaluation of ``info.state``, logged; no step, no checkpoint."""
        self.hook_set.call("on_train_begin", info)
        control.clear()
        self._act(info, Decision(eval=True))
        self.stop_reason = "trainer.eval_only"
        logger.info("trainer.eval_only: evaluated step %d, no training", info.step)
        self.hook_set.call("on_train_end", info)
        control.clear()

    def _propose(self, step: int, control: Control, signals: StopSignals) -> Decision:
        """This process's decision for the end of ``step``, before the processes agree."""
        asked = control.proposal()
        stop = (
            asked.stop
            or (f"signal {signals.received}" if signals.received else None)
            or self._over_time()
        )
        due = self.checkpointer.due(step)
        if due == "temporary" and (blocker := self.hook_set.temporary_save_blocker(step)):
            logger.info("temporary checkpoint at step %d held back by hook %s", step, blocker)
            due = None
        return Decision(asked.eval, asked.save or due, stop)

    def _final_decision(self, step: int, control: Control) -> Decision:
        """After the last step: the eval asked for, and the closing checkpoint."""
        save = None
        if self.config.checkpointer.save_at_end or control.save_requested:
            permanent = (
                self.stop_reason is None
                or control.save_requested
                or self.config.checkpointer.is_permanent(step)
            )
            save = "permanent" if permanent else "temporary"
        return Decision(eval=control.eval_requested, save=save)

    def _batch_size_args(self, step: int) -> dict[str, int]:
        """``train_step`` arguments for step ``step`` (made from batch ``step - 1``) under a batch-size schedule."""
        if self.batch_schedule.is_constant:
            return {}
        size = self.batch_schedule.size_at(step - 1)
        return {"num_microbatches": self.config.microbatches(self.runtime.data_parallel_size, size)}

    def _step_info(self, step, state, metrics, control, previous=None, dispatched_at=None):
        metrics = dict(metrics)
        traced = metrics.pop(TRACED, ())
        return StepInfo(
            step,
            state,
            metrics,
            previous=previous,
            dispatched_at=dispatched_at,
            control=control,
            run_dir=self.run_dir,
            eval_weights=self.hook_set.eval_weights,
            traced_outputs=dict(zip(map(id, self.hook_set.jit_hooks), traced, strict=bool(traced))),
        )

    def _act(self, info: StepInfo, decision: Decision) -> None:
        """Evaluate, then save, as ``decision`` says."""
        if decision.eval:
            results = self.hook_set.evaluate(info)
            if results:
                info.log(results)
                self.hook_set.call("on_eval", info, results)
        if decision.save:
            self._save(info, permanent=decision.save == "permanent")

    def _over_time(self) -> str | None:
        limit = self.config.max_train_time
        if limit is not None and time.perf_counter() - self._started > limit.total_seconds():
            return f"trainer.max_train_time ({limit}) reached"
        return None

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

    def _complete(self, step: int, metrics: dict[str, jax.Array]) -> CompletedStep:
        """``step`` as finished, its scalar metrics on the host (waits for it)."""
        host = {k: v.item() for k, v in jax.device_get(metrics).items() if v.size == 1}
        now = time.perf_counter()
        done = CompletedStep(step, host, now - self._last_done, now)
        self._last_done = now
        return done

    def _flush(self, info: StepInfo) -> None:
        """Send the step's record to the tracker, after the hooks' ``pre_log``."""
        if not info.record:
            return
        record = dict(info.record)
        info.record.clear()
        self.hook_set.pre_log(info, record)
        if record:
            self.tracker.log(record, step=info.step)

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
