"""lm-eval's task index kept on disk (``loomax.downstream.task_index``): read back by a later
process instead of indexed again, and indexed again when a YAML changes or the file is damaged."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from loomax.downstream import task_index

# in the test extra: fails, not skips, without it
pytestmark = pytest.mark.usefixtures("needs_lm_eval")


def summary(index) -> dict:
    return {name: (e.kind, str(e.yaml_path), e.cfg, e.tags) for name, e in index.items()}


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """The folders lm-eval indexes (``task_index._build`` calls), in order."""
    seen: list[Path] = []
    build = task_index._build
    monkeypatch.setattr(task_index, "_build", lambda folder: seen.append(folder) or build(folder))
    return seen


def test_a_folders_index_is_read_back_until_one_of_its_yamls_changes(
    tasks_dir, tmp_path, monkeypatch, builds, lm_eval_tasks
):
    from lm_eval.tasks._index import TaskIndex

    monkeypatch.setenv("LOOMAX_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "tasks"
    shutil.copytree(tasks_dir, folder)
    first = task_index.index_folder(folder)
    assert builds == [folder] and summary(first) == summary(TaskIndex.build([folder]))
    assert {"tiny_mc", "tiny_ppl", "tiny_gen"} <= set(first)
    [kept] = (tmp_path / "cache" / "lm_eval_index").glob("*.pkl")

    task_index._pickled_index.cache_clear()  # as a later process
    again = task_index.index_folder(folder)
    assert builds == [folder] and summary(again) == summary(first)  # read back, not built
    assert again["tiny_mc"] is not first["tiny_mc"]  # a copy of its own for each manager

    kept.write_bytes(kept.read_bytes()[:1000])  # damaged: indexed again, replaced
    task_index._pickled_index.cache_clear()
    assert summary(task_index.index_folder(folder)) == summary(first)
    assert builds == [folder, folder] and summary(pickle.loads(kept.read_bytes())) == summary(first)

    t = lm_eval_tasks
    t.write_task(folder, "tiny_mc2", t.MC, data="mc2", **t.MULTIPLE_CHOICE)
    edited = task_index.index_folder(folder)
    assert builds == [folder, folder, folder] and "tiny_mc2" in edited
    assert len(list(kept.parent.glob("*.pkl"))) == 2


def test_the_manager_reads_the_builtin_tasks_from_disk_and_a_folder_overrides_them(
    tasks_dir, tmp_path, monkeypatch
):
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    builtin = Path(lm_eval.tasks.__file__).parent
    folder = tmp_path / "tasks"
    shutil.copytree(tasks_dir, folder)
    mc = (folder / "tiny_mc.yaml").read_text()
    (folder / "arc_easy.yaml").write_text(mc.replace('"task": "tiny_mc"', '"task": "arc_easy"'))
    task_index.index_folder(builtin)  # on disk now, if no earlier process put it there
    task_index._pickled_index.cache_clear()  # as a later process
    indexed: list[list[Path]] = []  # the folders lm-eval's own indexing reads, by call
    build = TaskIndex.build

    def counted(paths, **options):
        indexed.append([Path(p) for p in paths])
        return build(paths, **options)

    monkeypatch.setattr(TaskIndex, "build", staticmethod(counted))
    manager = task_index.manager_with_cached_defaults([str(folder)])
    assert indexed == [[folder]]  # lm-eval's own tasks read back from disk, not indexed
    assert TaskIndex.__dict__["build"].__func__ is counted  # lm-eval's indexing as it was
    assert {"arc_challenge", "hellaswag", "tiny_mc", "arc_easy"} <= set(manager.all_tasks)
    assert manager.task_index["arc_easy"].yaml_path == folder / "arc_easy.yaml"
    assert manager.task_index["arc_challenge"].yaml_path.is_relative_to(builtin)
    assert manager.all_tasks == sorted(manager.task_index)
