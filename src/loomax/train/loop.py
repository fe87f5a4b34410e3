"""The trainer's loop: ``training_steps`` yields each step's ``StepInfo``; ``train`` drains it.

A base class of ``Trainer``: it uses the trainer's ``config``, ``hook_set``, ``checkpointer``,
``tracker``, ``runtime``, ``batch_schedule``, ``epochs``, ``train_step`` and its saving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import jax

from loomax.train.control import Control, Decision, StepAgreement, StopSignals
from loomax.train.hooks import CompletedStep, StepInfo, host_mean
from loomax.train.saving import saves_at_start
from loomax.train.state import TrainerState
from loomax.train.step import TRACED

logger = logging.getLogger(__name__)


class TrainingLoop:
    """``train`` and ``training_steps``, and the per-step decisions they take."""

    def train(self, state: TrainerState, batches: Iterator[Any] | Sequence[Any]) -> StepInfo:
        """Train from ``state`` to ``num_train_steps`` on ``batches``; returns the final ``StepInfo``.

        Step k+1 is dispatched before the host waits for step k, so the device never idles
        on the host; only hooks that read this step's values (at their intervals) wait.
        After each step's hooks the trainer takes a ``Decision`` (eval, then save, then
        stop) from what they asked through ``info.control``, the checkpointer's policies,
        signals and ``max_train_time``; every process takes process 0's decision.
        """
        steps = self.training_steps(state, batches)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def training_steps(
        self, state: TrainerState, batches: Iterator[Any] | Sequence[Any]
    ) -> Generator[StepInfo, None, StepInfo]:
        """``train`` one step at a time: yields each step's ``StepInfo`` after its hooks ran,
        before the trainer takes the step's decision; returns (``StopIteration.value``) the
        final one.

        The code between two ``next`` calls is one more hook of the step: it reads
        ``info.state`` and ``info.metrics`` and may ask for an eval, a save or a stop through
        ``info.control``, which the trainer takes at the end of this step. Leaving the loop
        (``break``, ``close()``) ends the run there, without that step's decision or the
        closing eval and checkpoint; a save in flight still commits.
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
        epochs = self.epochs
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
                    epoch = epochs.of_step(step) if epochs else None
                    if epochs and epochs.begins_at(step):
                        self.hook_set.call("on_epoch_begin", info, epoch)
                    self.hook_set.step_begins(step)
                    batch = self.hook_set.transform_batch(step, next(batches))
                    dispatched_at = time.perf_counter()
                    state, metrics = self.train_step(state, batch, **self.step_args(step))
                    if pending is not None:  # the step before is done: its values are on the host
                        previous = self._complete(*pending)
                    self._flush(info)  # the record of the step before, now that this one is queued
                    info = self._step_info(step, state, metrics, control, previous, dispatched_at)
                    self.hook_set.call("on_step", info)
                    if epochs and epochs.ends_at(step):
                        self.hook_set.call("on_epoch_end", info, epoch)
                    pending = (step, info.metrics)
                    yield info  # the caller's code runs here, as one more hook of this step
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
        except GeneratorExit:  # the caller stopped iterating: no closing eval or save
            raise
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

    def step_args(self, step: int) -> dict[str, Any]:
        """``train_step`` arguments for step ``step`` (made from batch ``step - 1``): its
        microbatches under a batch-size schedule, the fragment it syncs under DiLoCo, and
        whether a hook asks it for activation statistics."""
        args: dict[str, Any] = {}
        if self.hook_set.activation_stats_at(step):
            args["activation_stats"] = True
        if self.config.diloco is not None:
            args["sync"] = self.config.diloco.synced_at(step)
        if not self.batch_schedule.is_constant:
            size = self.batch_schedule.size_at(step - 1)
            dp = self.runtime.data_parallel_size
            args["num_microbatches"] = self.config.microbatches(dp, size)
        return args

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
            per_worker=self.config.diloco is not None,
            epoch=self.epochs.of_step(max(step, 1)) if self.epochs else None,
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

    def _complete(self, step: int, metrics: dict[str, jax.Array]) -> CompletedStep:
        """``step`` as finished, its scalar metrics on the host (waits for it)."""
        if self.config.diloco is not None:
            host = {k: host_mean(v) for k, v in metrics.items()}
        else:
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
