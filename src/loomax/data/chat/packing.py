"""Conversations packed into rows of ``seq_len`` tokens, with loss weights and document ids.

A packed row is an int32 array ``[3, seq_len]`` (a batch of them: ``[batch, 3, seq_len]``):

- ``row[TOKENS]``: token ids (padding: ``pad_id``);
- ``row[WEIGHTS]``: 1 where the loss counts the prediction made at this position, i.e.
  where the next token is a trained token of the same conversation (never at a
  conversation's last token, so no conversation is trained to predict the next one);
- ``row[SEGMENTS]``: the conversation's index in the row (padding: -1), which keeps
  attention within each conversation.

Packing never splits a conversation, so a conversation's tokens and weights are the same
packed or alone: only its offset in the row differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOKENS, WEIGHTS, SEGMENTS = 0, 1, 2


def assign_rows(lengths: Sequence[int], seq_len: int, method: str = "first_fit") -> list[list[int]]:
    """Which conversations go in each row, in order: ``first_fit`` puts each in the first row
    with room, ``best_fit`` in the row it leaves fullest (ties: the first), ``none`` one per
    row. Deterministic: the same lengths always give the same rows."""
    rows: list[list[int]] = []
    free = np.zeros(0, dtype=np.int64)
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise ValueError(f"conversation {i} has {n} tokens, more than seq_len {seq_len}")
        fits = np.flatnonzero(free >= n) if method != "none" else np.zeros(0, dtype=np.int64)
        if len(fits) == 0:
            rows.append([i])
            free = np.append(free, seq_len - n)
            continue
        row = fits[0] if method == "first_fit" else fits[np.argmin(free[fits])]
        rows[row].append(i)
        free[row] -= n
    return rows


def conversation_weights(trained: np.ndarray) -> np.ndarray:
    """Per position, whether the prediction of the next token is trained (0 at the last)."""
    w = np.zeros(len(trained), dtype=np.int32)
    w[:-1] = trained[1:]
    return w


def pack_rows(
    conversations: Sequence[tuple[np.ndarray, np.ndarray]],
    rows: list[list[int]],
    seq_len: int,
    pad_id: int,
) -> np.ndarray:
    """``[len(rows), 3, seq_len]`` int32: the ``(ids, trained)`` conversations laid out as
    ``rows`` says (see the module docstring)."""
    out = np.zeros((len(rows), 3, seq_len), dtype=np.int32)
    out[:, TOKENS] = pad_id
    out[:, SEGMENTS] = -1
    for r, members in enumerate(rows):
        at = 0
        for segment, i in enumerate(members):
            ids, trained = conversations[i]
            end = at + len(ids)
            out[r, TOKENS, at:end] = ids
            out[r, WEIGHTS, at:end] = conversation_weights(trained)
            out[r, SEGMENTS, at:end] = segment
            at = end
    return out
