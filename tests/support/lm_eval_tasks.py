"""Tiny lm-eval tasks over local JSONL files, and the small corpus their tokenizer learns.

Nothing is downloaded: lm-eval reads the files with the `json` dataset builder. Shared by
tests/downstream (the `lm_eval_tasks` fixture) and tests/hooks/test_downstream_eval.py.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The cat sat on the mat. The dog sat on the log.",
    "Paris is the capital of France. Rome is the capital of Italy.",
    "One plus one is two. Two plus two is four.",
    "Water is wet and fire is hot; ice is cold.",
] * 5

MC = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "sky"], "answer": 0},
    {"question": "Paris is the capital of", "choices": ["Italy", "France"], "answer": 1},
    {"question": "Two plus two is", "choices": ["four", "five", "one"], "answer": 0},
    {"question": "Fire is", "choices": ["cold", "hot"], "answer": 1},
    {"question": "Ice is", "choices": ["cold", "hot", "wet"], "answer": 0},
]
DOCS = [
    {"text": "The dog sat on the log. " * 4},
    {"text": "Rome is the capital of Italy."},
    {"text": "Water is wet. " * 12},
]
QA = [
    {"question": "The cat sat on the", "answer": " mat"},
    {"question": "One plus one is", "answer": " two"},
]

MULTIPLE_CHOICE = {
    "output_type": "multiple_choice",
    "doc_to_text": "{{question}}",
    "doc_to_choice": "{{choices}}",
    "doc_to_target": "{{answer}}",
    "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
}
"""A multiple-choice task's body over rows like ``MC``."""


def rolling(*metrics: str) -> dict:
    """A rolling log-likelihood task's body over rows like ``DOCS``."""
    return {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": m} for m in metrics],
    }


def write_task(root: Path, name: str, rows: list[dict], data: str | None = None, **body) -> Path:
    """``root/<name>.yaml``, an lm-eval task over ``rows`` written to ``root/<data or
    name>.jsonl`` (its datasets cache in ``root``, not ~/.cache)."""
    path = root / f"{data or name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {"test": str(path)},
            "cache_dir": str(root / "datasets_cache"),
        },
        "test_split": "test",
        **body,
    }
    out = root / f"{name}.yaml"
    out.write_text(json.dumps(spec, indent=1))
    return out
