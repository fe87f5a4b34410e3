"""Prompts with checkable answers: the jsonl reader and the shipped task, sorting letters.

A prompt file has one ``{"prompt": str, "answer": str}`` object a line. The shipped task
lists 3 to 6 distinct letters of ``a``–``l``, ``sort: d a h =``; the answer is the letters
in alphabetical order, `` a d h``. ``python -m loomax.rl.tasks OUT_DIR`` writes
``train.jsonl`` (2000 prompts) and ``validation.jsonl`` (200 other prompts), seeded: the
files in ``config/rl/sort_letters/``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loomax.errors import DataSourceError, MissingFileError

LETTERS = "abcdefghijkl"
"""The letters the shipped prompts draw from."""


@dataclass(frozen=True)
class Prompt:
    """A prompt and the reference answer its rewards check."""

    prompt: str
    answer: str | None


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of a jsonl file; a bad line fails naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such prompt file")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataSourceError(f"{path}:{number}: not JSON ({e.msg})") from e
            if (
                not isinstance(row, dict)
                or not isinstance(row.get("prompt"), str)
                or not row["prompt"]
            ):
                raise DataSourceError(f"{path}:{number}: needs a non-empty string 'prompt'")
            answer = row.get("answer")
            if answer is not None and not isinstance(answer, str):
                raise DataSourceError(f"{path}:{number}: 'answer' must be a string")
            prompts.append(Prompt(row["prompt"], answer))
    if not prompts:
        raise DataSourceError(f"{path}: no prompts")
    return prompts


def sort_letters(rng: np.random.Generator) -> dict[str, str]:
    """One prompt of the shipped task and its answer."""
    k = int(rng.integers(3, 7))
    letters = [str(c) for c in rng.choice(list(LETTERS), size=k, replace=False)]
    return {
        "prompt": "sort: " + " ".join(letters) + " =",
        "answer": " " + " ".join(sorted(letters)),
    }


def make_sets(n_train: int = 2000, n_validation: int = 200, seed: int = 0):
    """``(train, validation)`` prompts; no validation prompt appears in train."""
    rng = np.random.default_rng(seed)
    validation: dict[str, dict] = {}
    while len(validation) < n_validation:
        row = sort_letters(rng)
        validation.setdefault(row["prompt"], row)
    train = []
    while len(train) < n_train:
        row = sort_letters(rng)
        if row["prompt"] not in validation:
            train.append(row)
    return train, list(validation.values())


def write_sets(out_dir: str | Path, **kwargs) -> None:
    """Write ``train.jsonl`` and ``validation.jsonl`` under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(("train", "validation"), make_sets(**kwargs), strict=True):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    write_sets(sys.argv[1] if len(sys.argv) > 1 else "config/rl/sort_letters")
