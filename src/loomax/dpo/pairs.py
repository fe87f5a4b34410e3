"""Preference pairs from jsonl: read and checked (file and line named), then tokenised.

Each line is ``{"prompt": str, "chosen": str, "rejected": str}``. A pair becomes two token
rows of ``seq_len``: ``[EOS] + prompt + response + [EOS]`` (EOS starts a document as in
pretraining, and ends the response), padded with EOS. Beside each row goes its response
mask: ``mask[t] = 1`` where token ``t + 1`` belongs to the response (its closing EOS
included), the positions whose next-token log-probs make the sequence log-prob. A pair too
long keeps its whole response (up to ``seq_len - 2`` tokens) and the end of its prompt.

A chat pair (TRL's conversational form) has a ``prompt`` of messages (``[{role, content},
...]``) and responses that are the assistant's reply (a string, or one assistant message
in a list). Each side is the conversation with the reply, rendered by the run's chat
template (``dpo.chat_template``) as ``loomax train`` renders chat data; its response mask
marks the positions predicting the reply's tokens (its end-of-turn marker included). A
conversation longer than ``seq_len`` keeps its end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loomax.data.chat.encode import check_messages
from loomax.errors import DataSourceError, MissingFileError

FIELDS = ("prompt", "chosen", "rejected")
"""The keys every pair has, each a string (``chosen`` and ``rejected`` not empty)."""


@dataclass(frozen=True)
class Pair:
    """One preference: a prompt and the response preferred over another."""

    prompt: str | list[dict]  # a string, or a chat pair's messages
    chosen: str
    rejected: str

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)

    def texts(self) -> list[str]:
        """The pair's texts (for training a tokenizer on them)."""
        prompt = (
            [self.prompt] if isinstance(self.prompt, str) else [m["content"] for m in self.prompt]
        )
        return [*prompt, self.chosen, self.rejected]


def _response(value, where: str, key: str) -> str:
    """A response: a string, or (chat) a list of one assistant message."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        if value[0].get("role") != "assistant" or not isinstance(value[0].get("content"), str):
            raise DataSourceError(f"{where}: {key!r} must be one assistant message with content")
        value = value[0]["content"]
    if not isinstance(value, str):
        raise DataSourceError(f"{where}: {key!r} must be a string (or one assistant message)")
    if not value:
        raise DataSourceError(f"{where}: {key!r} is empty")
    return value


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
            prompt = record["prompt"]
            if isinstance(prompt, list):  # a chat pair: the conversation so far
                prompt = check_messages(prompt, f"{where}: 'prompt'")
            elif not isinstance(prompt, str):
                raise DataSourceError(f"{where}: 'prompt' must be a string or a list of messages")
            chosen, rejected = (_response(record[k], where, k) for k in ("chosen", "rejected"))
            pairs.append(Pair(prompt, chosen, rejected))
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
    pairs: Sequence[Pair],
    tokenizer,
    eos: int,
    seq_len: int,
    max_prompt_len: int | None = None,
    template=None,
) -> PairArrays:
    """Token rows and response masks of ``pairs`` (see the module docstring); chat pairs are
    rendered with ``template`` (a ``loomax.data.chat.encode.ChatTemplate``)."""
    prompts = _encode(tokenizer, [p.prompt if not p.is_chat else "" for p in pairs])
    out = {}
    for side in ("chosen", "rejected"):
        responses = _encode(tokenizer, [getattr(p, side) for p in pairs])
        tokens = np.full((len(pairs), seq_len), eos, np.int32)
        mask = np.zeros((len(pairs), seq_len), np.float32)
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            if pairs[i].is_chat:
                row, weights = _chat_row(
                    pairs[i].prompt, getattr(pairs[i], side), template, tokenizer
                )
                tokens[i, : len(row[-seq_len:])] = row[-seq_len:]
                mask[i, : len(row[-seq_len:])] = weights[-seq_len:]
                continue
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


def _chat_row(messages: list[dict], reply: str, template, tokenizer):
    """A chat pair's side: the conversation with the reply, and per position whether it
    predicts a token of the reply (its end-of-turn marker included)."""
    from loomax.data.chat.encode import encode_chat
    from loomax.data.chat.packing import conversation_weights

    if template is None:
        raise ValueError("chat pairs need a chat template (dpo.chat_template)")
    turn = [*messages, {"role": "assistant", "content": reply}]
    ids, trained = encode_chat(turn, template, tokenizer, "last_assistant")
    return ids, conversation_weights(trained).astype(np.float32)


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
