"""Downstream evaluation of a Loomax model with lm-eval (the ``eval`` extra).

``lm_eval_model(model, tokenizer)`` is an lm-eval ``LM`` (``loomax.downstream.lm``);
``evaluate_tasks`` runs lm-eval's own evaluator (``lm_eval.simple_evaluate``) on it with
tasks from a prepared set (``loomax.downstream.prepared``: lm-eval's tasks rendered once
into local files) and from ``include_path`` folders of task YAMLs, with the Hugging Face hub
switched off. lm-eval is imported only inside these functions: ``import loomax`` never
needs it. See docs/downstream.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loomax.downstream.prepared import (
    check_prepared,
    leaf_tasks,
    prepare_command,
    read_manifest,
    serve_prepared,
)
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


def _yaml_state(folder: str | Path) -> tuple[tuple[str, int, int], ...]:
    """The task YAMLs under ``folder``, each with its modification time and size."""
    files = sorted(Path(folder).rglob("*.yaml"))
    return tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)


@functools.lru_cache(maxsize=8)
def _manager(include_defaults: bool, folders: tuple[tuple[str, tuple], ...]) -> Any:
    """lm-eval's ``TaskManager`` over ``folders`` (each with its YAMLs' state, so an edited
    folder is indexed again). A process builds the manager of one set of folders once;
    lm-eval instantiates fresh tasks from it on every ``load``. Its index of lm-eval's
    ~14,700 built-in task YAMLs (~7 CPU-s to build, 2-core AMD EPYC) is read from disk
    where an earlier process kept it (``loomax.downstream.task_index``)."""
    from lm_eval.tasks import TaskManager

    from loomax.downstream.task_index import manager_with_cached_defaults

    paths = [folder for folder, _ in folders]
    if include_defaults:
        return manager_with_cached_defaults(paths)
    return TaskManager(include_path=paths or None, include_defaults=False)


def task_manager(
    tasks: Sequence[str],
    include_path: str | Path | Sequence[str | Path] | None = None,
    *,
    include_defaults: bool = True,
    where: str = "--include_path",
    prepared: str | Path | None = None,
    hub: bool = False,
) -> Any:
    """lm-eval's ``TaskManager`` over ``include_path`` (and, unless ``include_defaults`` is
    false, lm-eval's own tasks), after checking lm-eval is installed, every folder exists,
    every task is known, and (unless ``hub``: ``loomax eval prepare``) every task of lm-eval's
    own is in the ``prepared`` set (they read the hub otherwise); ``UserError`` naming
    ``where``, the tasks and the fix otherwise."""
    require_lm_eval()
    import lm_eval.tasks

    paths = [include_path] if isinstance(include_path, str | Path) else list(include_path or [])
    for path in paths:
        if not Path(path).is_dir():
            raise UserError(f"{where}: include_path {path} does not exist or is not a folder")
    manager = _manager(include_defaults, tuple((str(p), _yaml_state(p)) for p in paths))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        searched = [f"include_path {p}" for p in paths]
        if include_defaults:
            searched.append("lm-eval's built-in tasks")
        raise UserError(
            f"{where}: unknown lm-eval task(s) {', '.join(unknown)} "
            f"(looked in {' and '.join(searched) or 'no task folder'})"
        )
    if hub:
        return manager
    builtin = Path(lm_eval.tasks.__file__).parent
    own = [t for t in tasks if _defined_under(manager, t, builtin)]
    if prepared is not None:
        manifest = read_manifest(prepared, where)
        check_prepared(prepared, [t for t in tasks if t in own or leaf_tasks(manifest, t)], where)
    elif own:
        raise UserError(
            f"{where}: lm-eval task(s) {', '.join(own)} read their documents from the Hugging "
            "Face hub, and evaluation reads only prepared files: run "
            f"`{prepare_command(own, 'DIR')}` where the hub is reachable, then point "
            "`prepared` (CLI: --prepared) at DIR"
        )
    return manager


def _defined_under(manager: Any, name: str, folder: Path) -> bool:
    """Whether task/group ``name``'s YAML lies under ``folder`` (lm-eval's own tasks)."""
    entry = manager.task_index.get(name)
    path = getattr(entry, "yaml_path", None)
    return path is not None and Path(path).resolve().is_relative_to(folder.resolve())


def evaluate_tasks(
    lm,
    tasks: Sequence[str],
    *,
    include_path: str | Path | Sequence[str | Path] | None = None,
    include_defaults: bool = True,
    prepared: str | Path | None = None,
    **options: Any,
) -> dict[str, Any]:
    """lm-eval's results for ``tasks`` (``task_manager``, then ``run_tasks`` with ``options``:
    limit, num_fewshot, seed, log_samples, bootstrap_iters)."""
    manager = task_manager(
        tasks, include_path, include_defaults=include_defaults, prepared=prepared
    )
    return run_tasks(lm, tasks, manager, prepared=prepared, **options)


def run_tasks(
    lm,
    tasks: Sequence[str],
    task_manager: Any,
    *,
    prepared: str | Path | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
    log_samples: bool = False,
    bootstrap_iters: int = 100000,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``tasks`` known to ``task_manager`` (built once by the
    caller), with every seed set to ``seed``, offline (``serve_prepared``: the tasks of the
    ``prepared`` set from its files, the hub switched off)."""
    lm_eval = require_lm_eval()
    # torch's generator is seeded only where torch is already in use (lm-eval's hf backend):
    # seeding it would import torch (~1.8 CPU-s) into a JAX run that never calls it
    torch_seed = seed if "torch" in sys.modules else None
    with serve_prepared(prepared), _env_info_without_torch():
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=task_manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=torch_seed,
            fewshot_random_seed=seed,
            bootstrap_iters=bootstrap_iters,
        )
    return dict(results or {})


@contextlib.contextmanager
def _env_info_without_torch() -> Iterator[None]:
    """lm-eval's results carry the versions of lm-eval and transformers as always, but not
    torch's ``collect_env`` report, which imports torch and runs ``pip list`` and other
    commands (~2.5 CPU-s) on every evaluation, and describes a torch install the JAX model
    does not use; ``pretty_env_info`` names the JAX backend instead."""
    import lm_eval.evaluator

    original = lm_eval.evaluator.add_env_info

    def add_env_info(storage: dict[str, Any]) -> None:
        from importlib.metadata import PackageNotFoundError, version

        import jax

        def installed(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "N/A"

        storage.update(
            pretty_env_info=f"jax {jax.__version__} on {jax.default_backend()}: "
            f"{jax.device_count()} devices in {jax.process_count()} processes",
            transformers_version=installed("transformers"),
            lm_eval_version=installed("lm_eval"),
            upper_git_hash=None,
        )

    lm_eval.evaluator.add_env_info = add_env_info
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = original


def write_results(results: dict[str, Any], path: str | Path) -> Path:
    """``results`` as lm-eval's results JSON at ``path`` (replaced whole)."""
    from lm_eval.utils import handle_non_serializable

    from loomax.atomic_files import replace_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    replace_text(path, text + "\n")
    return path
