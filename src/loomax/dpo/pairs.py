"""Preference pairs from jsonl: read and checked (file and line named), then tokenised.

Each line is ``{"prompt": str, "chosen": str, "rejected": str}``. A pair becomes two token
rows of ``seq_len``: ``[EOS] + prompt + response + [EOS]`` (EOS starts a document as in
pretraining, and ends the response), padded with EOS. Beside each row goes its response
mask: ``mask[t] = 1`` where token ``t + 1`` belongs to the response (its closing EOS
included), the positions whose next-token log-probs make the sequence log-prob. A pair too
long keeps its whole response (up to ``seq_len - 2`` tokens) and the end of its prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loomax.errors import DataSourceError, MissingFileError

FIELDS = ("prompt", "chosen", "rejected")
"""The keys every pair has, each a string (``chosen`` and ``rejected`` not empty)."""


@dataclass(frozen=True)
class Pair:
    """One preference: a prompt and the response preferred over another."""

    prompt: str
    chosen: str
    rejected: str


def read_pairs(path: str | Path) -> list[Pair]:
    """The pairs of a jsonl file; a bad line fails with ``DataSourceError`` naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such preference file")
    pairs = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataSourceError(f"{where}: not a JSON object ({e})") from None
            if not isinstance(record, dict):
                raise DataSourceError(f"{where}: not a JSON object")
            for key in FIELDS:
                if key not in record:
                    raise DataSourceError(
                        f"{where}: the pair has no {key!r} (needs {', '.join(FIELDS)})"
                    )
                if not isinstance(record[key], str):
                    raise DataSourceError(f"{where}: {key!r} must be a string")
            for key in ("chosen", "rejected"):
                if not record[key]:
                    raise DataSourceError(f"{where}: {key!r} is empty")
            pairs.append(Pair(record["prompt"], record["chosen"], record["rejected"]))
    if not pairs:
        raise DataSourceError(f"{path}: no preference pairs")
    return pairs


@dataclass(frozen=True)
class PairArrays:
    """Tokenised pairs: token rows ``[pairs, seq_len]`` (int32) and response masks (float32)."""

    chosen: np.ndarray
    chosen_mask: np.ndarray
    rejected: np.ndarray
    rejected_mask: np.ndarray

    def __len__(self) -> int:
        return self.chosen.shape[0]


def tokenize_pairs(
    pairs: Sequence[Pair], tokenizer, eos: int, seq_len: int, max_prompt_len: int | None = None
) -> PairArrays:
    """Token rows and response masks of ``pairs`` (see the module docstring)."""
    prompts = _encode(tokenizer, [p.prompt for p in pairs])
    out = {}
    for side in ("chosen", "rejected"):
        responses = _encode(tokenizer, [getattr(p, side) for p in pairs])
        tokens = np.full((len(pairs), seq_len), eos, np.int32)
        mask = np.zeros((len(pairs), seq_len), np.float32)
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            response = (response + [eos])[: seq_len - 2]
            room = seq_len - 1 - len(response)
            if max_prompt_len is not None:
                room = min(room, max_prompt_len)
            prompt = prompt[max(0, len(prompt) - room) :] if room > 0 else []
            row = [eos, *prompt, *response]
            tokens[i, : len(row)] = row
            start = 1 + len(prompt)  # the first response token's position
            mask[i, start - 1 : len(row) - 1] = 1.0
        out[side], out[f"{side}_mask"] = tokens, mask
    return PairArrays(**out)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts)] if texts else []


def pair_fields(arrays: PairArrays) -> dict[str, np.ndarray]:
    """A batch's arrays for every pair of ``arrays``: the chosen and rejected rows, their
    response masks, and ``valid`` (1: a real pair; padding rows carry 0)."""
    return {
        "chosen": arrays.chosen,
        "chosen_mask": arrays.chosen_mask,
        "rejected": arrays.rejected,
        "rejected_mask": arrays.rejected_mask,
        "valid": np.ones(len(arrays), np.float32),
    }


def pair_batches(arrays: PairArrays, rows: int, extra: dict[str, np.ndarray] | None = None):
    """``arrays`` (and per-pair ``extra`` arrays) as batches of ``rows`` pairs, the last one
    padded with copies of pair 0 that carry ``valid = 0``: a list of dicts of arrays."""
    n = len(arrays)
    fields = pair_fields(arrays) | (extra or {})
    batches = []
    for start in range(0, n, rows):
        index = np.arange(start, start + rows)
        batch = {k: v[np.where(index < n, index, 0)] for k, v in fields.items()}
        batch["valid"] = np.where(index < n, batch["valid"], 0.0).astype(np.float32)
        batches.append(batch)
    return batches


def fill_column(batches: list[dict[str, np.ndarray]], name: str, values: np.ndarray) -> None:
    """Write per-pair ``values`` into column ``name`` of ``pair_batches``' batches, in place
    (padding rows keep theirs): the held-out batches get the reference log-probs this way,
    built before the reference pass has run."""
    rows = batches[0][name].shape[0]
    for i, batch in enumerate(batches):
        part = values[i * rows : (i + 1) * rows]
        batch[name][: len(part)] = part
