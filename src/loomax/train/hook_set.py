"""``HookSet``: a run's hooks in their running order, and what they contribute to the step.

The trainer keeps one; it adds hooks, calls their lifecycle methods (naming the running
hook for control requests), gathers eval results, checkpoint files and hook states.
"""

from __future__ import annotations

import logging
from typing import Any

import optax

from loomax.train.hooks import Hook, StepInfo, hook_state_keys
from loomax.train.step import JitHook, StateExtra

logger = logging.getLogger(__name__)


class HookSet:
    """Hooks by ``priority`` (higher first), then registration order."""

    def __init__(self):
        self.hooks: list[Hook] = []
        self.jit_hooks: list[JitHook] = []
        """Functions computed inside the step, in the order their outputs travel."""
        self.extras: dict[str, StateExtra] = {}
        """Arrays hooks keep in ``TrainerState.extras``, by name."""
        self.eval_weights: str | None = None
        """The ``extras`` entry evaluators use instead of the model weights (EMA), if any."""

    def add(
        self,
        hook: Hook,
        optimizer: optax.GradientTransformation,
        *,
        state_made: bool,
        compiled: bool,
    ) -> optax.GradientTransformation:
        """Add ``hook``; returns the optimizer to train with (the hook may wrap it).

        A hook that changes the optimizer or the state must come before the state is
        made, and one with ``JitHook``s before the step is compiled.
        """
        wrapped, jit_hooks, extras = (
            hook.wrap_optimizer(optimizer),
            hook.jit_hooks(),
            hook.state_extras(),
        )
        if (wrapped is not optimizer or extras) and state_made:
            raise RuntimeError(
                f"hook {hook.name} changes the optimizer or the state: add it before initial_state()"
            )
        if jit_hooks:
            self.add_jit_hooks(jit_hooks, f"hook {hook.name} (it has JitHooks)", compiled=compiled)
        for name, extra in extras.items():
            if name in self.extras:
                raise ValueError(f"two hooks keep state extras named {name!r}")
            self.extras[name] = extra
        if getattr(hook, "provides_eval_weights", None):
            self.eval_weights = hook.provides_eval_weights
        self.hooks.append(hook)
        self.hooks.sort(key=lambda h: -h.priority)  # stable: registration order among equals
        return wrapped

    def add_jit_hooks(self, jit_hooks: list[JitHook], what: str, *, compiled: bool) -> None:
        """Compute ``jit_hooks`` inside the step (only before the step is compiled)."""
        if compiled:
            raise RuntimeError(f"{what} must be added before the first call to train()")
        self.jit_hooks.extend(jit_hooks)

    def call(self, method: str, info: StepInfo, *args: Any) -> None:
        """Run ``method`` of every hook (``on_step`` only where due), naming the running hook."""
        for hook in self.hooks:
            if method == "on_step" and info.step % hook.every:
                continue
            info.control.running = hook.name
            try:
                getattr(hook, method)(info, *args)
            finally:
                info.control.running = None

    def step_begins(self, step: int) -> None:
        """Run every due hook's ``on_step_begin(step)`` before step ``step`` is dispatched."""
        for hook in self.hooks:
            if step % hook.every == 0:
                hook.on_step_begin(step)

    def transform_batch(self, step: int, batch: Any) -> Any:
        """The batch of ``step`` after every hook's ``transform_batch``."""
        for hook in self.hooks:
            batch = hook.transform_batch(step, batch)
        return batch

    def evaluate(self, info: StepInfo) -> dict[str, float]:
        """Every evaluator's results, merged."""
        results: dict[str, float] = {}
        for hook in self.hooks:
            results.update(hook.run_eval(info) or {})
        return results

    def activation_stats_at(self, step: int) -> bool:
        """Whether any hook asks step ``step`` for activation statistics."""
        return any(hook.activation_stats_at(step) for hook in self.hooks)

    def pre_log(self, info: StepInfo, record: dict[str, Any]) -> None:
        """Let every hook change ``record`` before it reaches the tracker."""
        for hook in self.hooks:
            hook.pre_log(info, record)

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        """Tell every hook about ``error``; a hook failing here is logged, not raised."""
        for hook in self.hooks:
            try:
                hook.on_error(info, error)
            except Exception:  # noqa: BLE001 - the original error matters more
                logger.exception("hook %s failed in on_error", hook.name)

    def temporary_save_blocker(self, step: int) -> str | None:
        """The name of a hook holding back a temporary checkpoint at ``step``, if any."""
        for hook in self.hooks:
            if hook.blocks_temporary_saves(step):
                return hook.name
        return None

    def checkpoint_files(self) -> dict[str, bytes]:
        """Files the hooks write into each checkpoint directory."""
        return {k: v for hook in self.hooks for k, v in hook.checkpoint_files().items()}

    def states(self) -> dict[str, Any]:
        """The stateful hooks' ``state_dict``s, by key (saved in checkpoint metadata)."""
        return {key: hook.state_dict() for key, hook in hook_state_keys(self.hooks).items()}

    def load_states(self, saved: dict[str, Any]) -> None:
        """Give each hook its saved state back; warn about states no hook claims."""
        keyed = hook_state_keys(self.hooks)
        for key, value in saved.items():
            if key in keyed:
                keyed[key].load_state_dict(value)
            else:
                logger.warning(
                    "checkpoint has state for hook %r, which this run does not have", key
                )
