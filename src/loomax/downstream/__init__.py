"""Downstream evaluation of a Loomax model with lm-eval (the ``eval`` extra).

``lm_eval_model(model, tokenizer)`` is an lm-eval ``LM`` (``loomax.downstream.lm``);
``evaluate_tasks`` runs lm-eval's own evaluator (``lm_eval.simple_evaluate``) on it with
tasks from lm-eval and from ``include_path`` folders of task YAMLs. lm-eval is imported
only inside these functions: ``import loomax`` never needs it. See docs/downstream.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loomax.downstream.scoring import Scorer, has_absolute_positions
from loomax.errors import MissingPackageError, UserError

__all__ = [
    "Scorer",
    "evaluate_tasks",
    "has_absolute_positions",
    "lm_eval_model",
    "require_lm_eval",
    "run_tasks",
    "task_manager",
    "write_results",
]


def require_lm_eval():
    """``import lm_eval``, or a ``MissingPackageError`` naming the ``eval`` extra."""
    try:
        import lm_eval
    except ImportError as e:
        raise MissingPackageError(
            "downstream evaluation needs the `lm-eval` package, which is not installed: "
            "pip install 'loomax[eval]'"
        ) from e
    return lm_eval


def lm_eval_model(model, tokenizer, **options):
    """A ``LoomaxLM`` (an lm-eval ``LM``) for ``model`` and its tokenizer (a ``Tokenizer``
    or a tokenizer.json path); ``options`` go to ``LoomaxLM``."""
    require_lm_eval()
    from loomax.downstream.lm import LoomaxLM

    return LoomaxLM(model, tokenizer, **options)


def task_manager(
    tasks: Sequence[str],
    include_path: str | Path | Sequence[str | Path] | None = None,
    *,
    include_defaults: bool = True,
    where: str = "--include_path",
) -> Any:
    """lm-eval's ``TaskManager`` over ``include_path`` (and, unless ``include_defaults`` is
    false, lm-eval's own tasks), after checking lm-eval is installed, every folder exists and
    every task is known; ``UserError`` naming ``where``, the tasks and the folders otherwise."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = [include_path] if isinstance(include_path, str | Path) else list(include_path or [])
    for path in paths:
        if not Path(path).is_dir():
            raise UserError(f"{where}: include_path {path} does not exist or is not a folder")
    manager = TaskManager(
        include_path=[str(p) for p in paths] or None, include_defaults=include_defaults
    )
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        searched = [f"include_path {p}" for p in paths]
        if include_defaults:
            searched.append("lm-eval's built-in tasks")
        raise UserError(
            f"{where}: unknown lm-eval task(s) {', '.join(unknown)} "
            f"(looked in {' and '.join(searched) or 'no task folder'})"
        )
    return manager


def evaluate_tasks(
    lm,
    tasks: Sequence[str],
    *,
    include_path: str | Path | Sequence[str | Path] | None = None,
    include_defaults: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """lm-eval's results for ``tasks`` (``task_manager``, then ``run_tasks`` with ``options``:
    limit, num_fewshot, seed, log_samples, bootstrap_iters)."""
    manager = task_manager(tasks, include_path, include_defaults=include_defaults)
    return run_tasks(lm, tasks, manager, **options)


def run_tasks(
    lm,
    tasks: Sequence[str],
    task_manager: Any,
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
    log_samples: bool = False,
    bootstrap_iters: int = 100000,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``tasks`` known to ``task_manager`` (built once by the
    caller), with every seed set to ``seed``."""
    lm_eval = require_lm_eval()
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=task_manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        bootstrap_iters=bootstrap_iters,
    )
    return dict(results or {})


def write_results(results: dict[str, Any], path: str | Path) -> Path:
    """``results`` as lm-eval's results JSON at ``path`` (replaced whole)."""
    from lm_eval.utils import handle_non_serializable

    from loomax.atomic_files import replace_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    replace_text(path, text + "\n")
    return path
