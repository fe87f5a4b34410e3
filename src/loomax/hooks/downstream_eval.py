"""Downstream evaluation during training: lm-eval tasks every N steps, logged as ``downstream/*``.

The model being trained (``info.eval_model``, cast for compute) is scored through
``loomax.downstream`` (``LoomaxLM``: jitted, packed scoring with the run's tokenizer) by
lm-eval's own evaluator, offline: lm-eval's own tasks come from a prepared set
(``loomax eval prepare``), custom ones from ``include_path``. lm-eval, the task names and
the prepared files are checked when the hook is built, before any compile or training step.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from loomax.errors import UserError
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

PREFIX = "downstream"


def downstream_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """lm-eval's results (``simple_evaluate``'s) as ``downstream/<task>/<metric>`` floats.

    Each numeric ``<metric>,<filter>`` of a task becomes ``downstream/<task>/<metric>``
    (``downstream/<task>/<filter>/<metric>`` for a filter other than ``none``); stderrs keep
    lm-eval's ``<metric>_stderr`` name. Every metric (not stderr) that several tasks report
    (groups left out) is also averaged over them as ``downstream/average/<metric>``.
    """
    per_task = results.get("results") or {}
    groups = set(results.get("groups") or {})
    out: dict[str, float] = {}
    values: dict[str, list[float]] = defaultdict(list)
    for task, metrics in per_task.items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, int | float):
                continue  # "alias", "samples", "N/A" stderrs
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{filt}/{metric}"
            out[f"{PREFIX}/{task}/{name}"] = float(value)
            if task not in groups and not metric.endswith("_stderr"):
                values[name].append(float(value))
    for name, vals in values.items():
        if len(vals) > 1:
            out[f"{PREFIX}/average/{name}"] = math.fsum(vals) / len(vals)
    return out


@hook_type("downstream_eval")
class DownstreamEvalHook(Hook):
    """Every ``every`` steps (and at the end with ``at_end``), runs lm-eval ``tasks`` on the
    model being trained and logs ``downstream/<task>/<metric>``, ``<metric>_stderr`` and
    ``downstream/average/<metric>`` (see ``downstream_metrics``).

    Every process runs the evaluation (the model may be sharded over them: the jitted
    scoring must run everywhere); the results join the step's record, which the tracker
    writes from process 0. ``prepare(model)`` casts the model for compute. The last step
    evaluated is saved with checkpoints, so a resumed run does not evaluate it again.
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """lm-eval tasks on the model being trained every N steps, logged as downstream/<task>/<metric>."""

        every: int = 1000
        """Evaluate every this many steps."""
        at_end: bool = True
        """Also evaluate after the last step."""
        tasks: list[str] = field(default_factory=list)
        """lm-eval task (or group) names, from include_path or lm-eval's own tasks."""
        include_path: str | None = None
        """A folder of lm-eval task YAMLs (offline tasks over local files)."""
        prepared: str | None = None
        """A task set made by `loomax eval prepare` (lm-eval's own tasks are read only from it)."""
        default_tasks: bool = True
        """Also index lm-eval's built-in tasks (false: faster, only include_path's names)."""
        limit: float | None = None
        """Evaluate the first this many documents of each task (< 1: a fraction); null = all."""
        num_fewshot: int | None = None
        """Few-shot examples per prompt; null = each task's default."""
        batch_size: int = 8
        """Rows of seq_len tokens per jitted scoring call."""
        bootstrap_iters: int = 1000
        """Bootstrap resamples of the stderrs lm-eval cannot compute in closed form (0: none)."""
        seed: int = 0
        """Seed of lm-eval's few-shot sampling and of generation."""

        def __post_init__(self):
            self.check_positive("every", "limit", "batch_size")
            self.check(bool(self.tasks), "tasks must not be empty")
            self.check(
                self.num_fewshot is None or self.num_fewshot >= 0,
                f"num_fewshot must be >= 0, got {self.num_fewshot}",
            )
            self.check(self.bootstrap_iters >= 0, "bootstrap_iters must be >= 0")

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        tokenizer: Any,
        prepare: Callable[[Any], Any] = lambda model: model,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.tokenizer, self.prepare = tokenizer, prepare
        from loomax.downstream import task_manager

        self.task_manager = task_manager(
            self.config.tasks,
            self.config.include_path,
            include_defaults=self.config.default_tasks,
            where="trainer.hooks (downstream_eval)",
            prepared=self.config.prepared,
        )
        self.last_step: int | None = None
        self.history: list[tuple[int, dict[str, float]]] = []
        """(step, metrics) of every evaluation logged."""

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        if context.tokenizer is None:
            raise UserError("trainer.hooks (downstream_eval) needs the run's tokenizer")
        prepare = (
            context.trainer_config.policy.cast_to_compute
            if context.trainer_config is not None
            else (lambda model: model)
        )
        return cls(config, tokenizer=context.tokenizer, prepare=prepare)

    def on_step(self, info: StepInfo) -> None:
        if info.step % self.config.every == 0:
            self._evaluate(info)

    def on_train_end(self, info: StepInfo) -> None:
        if self.config.at_end:
            self._evaluate(info)

    def evaluate(self, model: Any) -> dict[str, float]:
        """The ``downstream/*`` metrics of ``model`` on the configured tasks."""
        from loomax.downstream import lm_eval_model, run_tasks

        c = self.config
        lm = lm_eval_model(model, self.tokenizer, batch_size=c.batch_size, seed=c.seed)
        limit = c.limit if c.limit is None or c.limit < 1 else int(c.limit)
        results = run_tasks(
            lm,
            c.tasks,
            self.task_manager,
            prepared=c.prepared,
            limit=limit,
            num_fewshot=c.num_fewshot,
            seed=c.seed,
            bootstrap_iters=c.bootstrap_iters,
        )
        return downstream_metrics(results or {})

    def _evaluate(self, info: StepInfo) -> None:
        if self.last_step == info.step:  # already logged (at_end after a due step, or resumed)
            return
        metrics = self.evaluate(self.prepare(info.eval_model))
        self.last_step = info.step
        self.history.append((info.step, metrics))
        info.log(metrics)
        logger.info(
            "downstream eval at step %d: %s",
            info.step,
            ", ".join(f"{k.removeprefix(PREFIX + '/')} {v:.4f}" for k, v in metrics.items()),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "history": [[s, m] for s, m in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = state.get("last_step")
        self.history = [(s, m) for s, m in state.get("history", [])]
