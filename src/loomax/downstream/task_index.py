"""lm-eval's index of its own task YAMLs, kept on disk between processes.

``lm_eval.tasks.TaskManager`` reads every task YAML it may serve when it is built: with
lm-eval's ~14,700 own tasks that is ~7 CPU-seconds (2-core AMD EPYC) in every process that
evaluates (``loomax eval``, a run with the ``downstream_eval`` hook), for an index that only
changes when lm-eval does. ``index_folder`` keeps a folder's index under
``$LOOMAX_CACHE_DIR`` (or ``~/.cache/loomax``), in ``lm_eval_index/``, keyed by the lm-eval
version and every YAML's path, size and modification time; reading it back costs ~0.7
CPU-seconds. ``manager_with_cached_defaults`` builds a ``TaskManager`` whose built-in part
comes from there (the folders given beside it are indexed as always).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loomax.atomic_files import replace_path

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """Where indexes are kept: ``$LOOMAX_CACHE_DIR/lm_eval_index`` or ``~/.cache/loomax/...``."""
    root = os.environ.get("LOOMAX_CACHE_DIR") or Path.home() / ".cache" / "loomax"
    return Path(root) / "lm_eval_index"


def folder_key(folder: Path) -> str:
    """A digest of the lm-eval version and of every task YAML under ``folder`` (path, size,
    modification time): an edited, added or removed YAML gives another key."""
    from importlib.metadata import version

    python = ".".join(map(str, sys.version_info[:2]))
    digest = hashlib.sha256(f"{version('lm_eval')}\n{python}\n{folder.resolve()}\n".encode())
    for path in sorted(folder.rglob("*.yaml")):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


@functools.lru_cache(maxsize=4)
def _pickled_index(folder: Path, key: str, root: Path) -> bytes:
    """The pickled index of ``folder`` (read from ``root``, or built and written there)."""
    path = root / f"{key}.pkl"
    with contextlib.suppress(OSError):
        return path.read_bytes()
    data = pickle.dumps(_build(folder), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        root.mkdir(parents=True, exist_ok=True)
        replace_path(path, lambda tmp: tmp.write_bytes(data))
    except OSError as error:  # a read-only home: index again next time, as lm-eval would
        log.warning("could not keep lm-eval's task index in %s: %s", root, error)
    return data


def _build(folder: Path) -> dict[str, Any]:
    """lm-eval's own indexing of one folder."""
    from lm_eval.tasks._index import TaskIndex

    return TaskIndex.build([folder])


def index_folder(folder: str | Path) -> dict[str, Any]:
    """lm-eval's index ``{name: Entry}`` of the task YAMLs under ``folder``, as
    ``TaskIndex.build([folder])`` gives it, from the on-disk cache when it is current.
    Each call returns a fresh copy (lm-eval may change entries as it loads tasks)."""
    folder, root = Path(folder), cache_root()
    key = folder_key(folder)
    try:
        return pickle.loads(_pickled_index(folder, key, root))
    except Exception as error:  # a damaged file (a full disk, say): index again, replace it
        log.warning("lm-eval's task index in %s is unreadable (%s): indexing again", root, error)
        (root / f"{key}.pkl").unlink(missing_ok=True)
        _pickled_index.cache_clear()
        return pickle.loads(_pickled_index(folder, key, root))


def manager_with_cached_defaults(include_path: Sequence[str]) -> Any:
    """``TaskManager(include_path=..., include_defaults=True)``, its index of lm-eval's own
    tasks read by ``index_folder``; the ``include_path`` folders are indexed after them and
    override a built-in task of the same name, as in lm-eval."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import TaskIndex

    builtin = Path(lm_eval.tasks.__file__).parent
    original = TaskIndex.__dict__["build"]
    index = index_folder(builtin)

    def build(paths, **options):
        paths = list(paths)
        if not paths or Path(paths[0]) != builtin:  # not the manager's own call: as always
            return original.__func__(paths, **options)
        for name, entry in original.__func__(paths[1:], **options).items():
            if name in index:
                log.warning(
                    "Task '%s' from %s overrides existing task from %s",
                    name,
                    entry.yaml_path,
                    index[name].yaml_path,
                )
            index[name] = entry
        return index

    TaskIndex.build = staticmethod(build)
    try:
        return TaskManager(include_path=list(include_path) or None, include_defaults=True)
    finally:
        TaskIndex.build = original
