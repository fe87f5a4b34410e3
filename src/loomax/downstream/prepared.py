"""Prepared task sets: lm-eval tasks' documents and requests in local files, read offline.

``prepare_tasks`` (``loomax eval prepare``) builds each task the ordinary way, where the
Hugging Face hub or a local copy of the dataset is reachable, and writes a versioned set::

    DIR/manifest.json          format, lm-eval and datasets versions; per task: its version,
                               each split (file, rows, sha256, features) and its requests
    DIR/<task>/<split>.jsonl   the documents lm-eval loaded (before the task's process_docs)
    DIR/<task>/requests.jsonl  the requests lm-eval renders from them (what the model is asked)

``serve_prepared(DIR)`` is the context in which ``run_tasks`` evaluates: lm-eval builds those
tasks from the local files (everything else about them, prompts and metrics, comes from the
installed lm-eval as usual), and the hub is switched off, so nothing is downloaded.
``check_prepared`` says, before anything expensive, which tasks a set lacks and the command
that makes them. Groups (e.g. ``mmlu``) are prepared as their leaf tasks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loomax.atomic_files import replace_text
from loomax.errors import UserError

FORMAT = 1
"""The manifest's format version; a set of another format is refused with the fix."""
MANIFEST = "manifest.json"


def prepare_command(tasks: Sequence[str], out: str | Path) -> str:
    """The shell command that prepares ``tasks`` into ``out``."""
    return f"loomax eval prepare --tasks {','.join(tasks)} --out {out}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_jsonl(path: Path, rows) -> dict[str, Any]:
    text = "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
    replace_text(path, text)
    return {"file": path.name, "rows": text.count("\n"), "sha256": _sha256(path)}


def _splits(task) -> list[str]:
    c = task.config
    names = [c.training_split, c.validation_split, c.test_split, c.fewshot_split]
    return list(dict.fromkeys(n for n in names if n))


def read_manifest(root: str | Path, where: str = "--prepared") -> dict[str, Any]:
    """``root``'s manifest; a ``UserError`` naming ``where`` if it is missing or not ours."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise UserError(
            f"{where}: {root} is not a prepared task set (no {MANIFEST}); "
            f"make one with `{prepare_command(['TASK'], root)}`"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: {path} line {e.lineno}: not valid JSON ({e.msg})") from e
    if manifest.get("format") != FORMAT:
        raise UserError(
            f"{where}: {path} has format {manifest.get('format')!r}, this Loomax reads "
            f"format {FORMAT}: prepare the tasks again with `loomax eval prepare`"
        )
    return manifest


def leaf_tasks(manifest: dict[str, Any], name: str) -> list[str]:
    """The prepared tasks ``name`` stands for (itself, or a group's leaves); [] if unknown."""
    if name in manifest["tasks"]:
        return [name]
    members = manifest.get("groups", {}).get(name)
    if members is None:
        return []
    return [leaf for member in members for leaf in leaf_tasks(manifest, member)]


def check_prepared(
    root: str | Path, tasks: Sequence[str], where: str = "--prepared"
) -> dict[str, Any]:
    """The manifest of ``root`` after checking every task (or group) of ``tasks`` is in it and
    its files are whole (sha256); a ``UserError`` naming the task, the file or the command
    that prepares what is missing otherwise."""
    manifest = read_manifest(root, where)
    missing = [t for t in tasks if not leaf_tasks(manifest, t)]
    if missing:
        raise UserError(
            f"{where}: task(s) {', '.join(missing)} not prepared in {root}; make them with "
            f"`{prepare_command(missing, root)}` where the hub (or a copy of the data) is reachable"
        )
    for name in {leaf for t in tasks for leaf in leaf_tasks(manifest, t)}:
        for entry in manifest["tasks"][name]["splits"].values():
            path = Path(root) / name / entry["file"]
            if not path.is_file() or _sha256(path) != entry["sha256"]:
                state = "is missing" if not path.is_file() else "does not match its sha256"
                raise UserError(
                    f"{where}: {path} {state} in the manifest (task {name}); prepare it again "
                    f"with `{prepare_command([name], root)}`"
                )
    return manifest


def prepare_tasks(
    tasks: Sequence[str],
    out: str | Path,
    task_manager: Any,
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Writes ``tasks`` (names known to ``task_manager``; groups expand to their leaves)
    into the prepared set ``out``, adding to what it holds; returns each written task's
    manifest entry. The manifest is written last, so an interrupted run leaves the set as
    it was. ``limit``/``num_fewshot``/``seed`` shape only the rendered ``requests.jsonl``."""
    from importlib.metadata import version

    from lm_eval.api.task import ConfigurableTask

    out = Path(out)
    manifest_path = out / MANIFEST
    manifest = (
        read_manifest(out, "--out")
        if manifest_path.exists()
        else {"format": FORMAT, "tasks": {}, "groups": {}}
    )
    loaded = task_manager.load(list(tasks))
    for name, task in loaded["tasks"].items():
        if type(task).download is not ConfigurableTask.download:
            raise UserError(
                f"--tasks: task {name} loads its data with its own code (a Python task class), "
                "which a prepared set cannot serve offline"
            )
    written: dict[str, dict[str, Any]] = {}
    for name, task in loaded["tasks"].items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        splits = {}
        for split in _splits(task):
            data = task.dataset[split]
            entry = _write_jsonl(folder / f"{split}.jsonl", data)
            splits[split] = {**entry, "features": data.features.to_dict()}
        written[name] = {
            "version": getattr(task, "VERSION", None),
            "output_type": task.config.output_type,
            "splits": splits,
            "requests": _render_requests(task, folder, limit, num_fewshot, seed),
            "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    manifest["tasks"].update(written)
    manifest["groups"].update(loaded.get("group_map") or {})
    manifest.update(format=FORMAT, lm_eval=version("lm_eval"), datasets=version("datasets"))
    replace_text(manifest_path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return written


def _render_requests(task, folder: Path, limit, num_fewshot, seed) -> dict[str, Any]:
    if num_fewshot is not None and task.get_config("num_fewshot") != 0:
        task.set_config(key="num_fewshot", value=num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=seed)
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    rows = (
        {"doc_id": r.doc_id, "idx": r.idx, "type": r.request_type, "arguments": list(r.arguments)}
        for r in task.instances
    )
    entry = _write_jsonl(folder / "requests.jsonl", rows)
    return {**entry, "num_fewshot": task.get_config("num_fewshot"), "limit": limit}


@contextlib.contextmanager
def serve_prepared(root: str | Path | None) -> Iterator[None]:
    """lm-eval builds the tasks of the prepared set ``root`` (if any) from its files, with
    the Hugging Face hub switched off for ``datasets`` and ``huggingface_hub`` throughout;
    a prepared task whose installed version differs from the set's is a ``UserError``."""
    import datasets
    import huggingface_hub.constants as hub
    from lm_eval.api.task import ConfigurableTask

    manifest = read_manifest(root) if root is not None else {"tasks": {}}
    original = ConfigurableTask.download

    def download(task, dataset_kwargs=None, **kwargs):
        entry = manifest["tasks"].get(task.config.task)
        if entry is None:
            return original(task, dataset_kwargs, **kwargs)
        if str(entry["version"]) != str(getattr(task, "VERSION", None)):
            raise UserError(
                f"--prepared: task {task.config.task} was prepared at version "
                f"{entry['version']} (lm-eval {manifest.get('lm_eval')}), the installed lm-eval "
                f"has version {getattr(task, 'VERSION', None)}: prepare it again with "
                f"`{prepare_command([task.config.task], root)}`"
            )
        task.dataset = datasets.DatasetDict(
            {
                split: _read_split(Path(root) / task.config.task / info["file"], info)
                for split, info in entry["splits"].items()
            }
        )

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    ConfigurableTask.download = download
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        ConfigurableTask.download = original
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _read_split(path: Path, info: dict[str, Any]):
    """One prepared split as an in-memory ``datasets.Dataset`` with its original features."""
    import datasets

    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    features = datasets.Features.from_dict(info["features"])
    return datasets.Dataset.from_list(rows, features=features)
