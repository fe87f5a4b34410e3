"""Readers for what the trackers write: JSON lines, wandb's offline run files, TensorBoard event files."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest


def wandb_records(path: Path):
    """The records of a ``run-<id>.wandb`` file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < 7:  # its header is still being written
        return
    assert data[:4] == b":W&B", path
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            return
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _items(items) -> dict:
    out = {}
    for item in items:
        key = "/".join(item.nested_key) if item.nested_key else item.key
        out[key] = json.loads(item.value_json)
    return out


def read_wandb_run(run_dir: Path, timeout: float = 30.0) -> dict:
    """An offline run: id, project, tags, notes, group, config, history rows, summary, files.

    wandb's service may still be writing the file when ``finish()`` returns: wait for its
    closing ``exit`` record.
    """
    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{path} has no exit record"
        time.sleep(0.1)
    run: dict = {"config": {}, "history": [], "summary": {}, "artifacts": []}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(
                id=r.run_id,
                project=r.project,
                tags=list(r.tags),
                notes=r.notes,
                group=r.run_group,
                resumed=r.resumed,
            )
            run["config"].update(_items(r.config.update))
        elif kind == "config":
            run["config"].update(_items(record.config.update))
        elif kind == "history":
            run["history"].append(_items(record.history.item))
        elif kind == "summary":
            run["summary"].update(_items(record.summary.update))
        elif kind == "artifact":
            art = record.artifact
            entries = {e.path: (e.size, e.digest) for e in art.manifest.contents}
            run["artifacts"].append(
                {"name": art.name, "type": art.type, "run_id": art.run_id, "files": entries}
            )
    run["files"] = sorted(p.name for p in (run_dir / "files").iterdir())
    return run


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch) -> Path:
    """WANDB_MODE=offline with WANDB_DIR in tmp_path; returns the folder of the offline runs."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path / "wandb-dir" / "wandb"


def offline_runs(root: Path) -> list[Path]:
    return sorted(root.glob("offline-run-*"))


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file, one dict a line."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_events(logdir: Path):
    """TensorBoard's own reader over the event files in ``logdir``, loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def text_of(events, tag: str) -> str:
    """The one text entry logged under ``tag``."""
    (event,) = events.Tensors(tag)
    return event.tensor_proto.string_val[0].decode()
