"""Scoring token sequences with a Loomax model, for downstream evaluation (no lm-eval here).

``Scorer.score(pieces)`` takes ``(context, continuation)`` token lists and returns, for each,
the summed log-probability of the continuation tokens given what precedes them and whether
every continuation token is the model's argmax. Pieces are packed several to a row of
``seq_len`` positions, each its own document (``segment_ids``), rows are grouped into batches
of ``batch_size`` (the last one padded with empty rows), and one jitted function scores a
batch: it compiles once for the whole evaluation.

Packing moves a piece away from position 0. That changes nothing for a model with relative
positions (rotary: Llama), but a model with learned absolute positions (GPT-2) would see
other position embeddings, so ``pack=None`` packs only models without a
``position_embeddings`` table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from loomax.models.axes import Position
from loomax.models.config import LmModel


@dataclass(frozen=True)
class _Piece:
    index: int
    tokens: list[int]
    """Model input: context + continuation minus its last token (at most ``seq_len``)."""
    scored: int
    """How many of the last positions are scored (the continuation's length, truncated)."""
    targets: list[int]


@dataclass
class _Row:
    tokens: np.ndarray
    segments: np.ndarray
    targets: np.ndarray
    used: int
    spans: list[tuple[int, int, int]]  # (piece index, start, stop) of the scored positions


def has_absolute_positions(model: LmModel) -> bool:
    """Whether ``model`` adds a learned embedding per absolute position (GPT-2)."""
    return hasattr(model, "position_embeddings")


class Scorer:
    """Log-likelihoods of continuations under ``model``, batched and packed (see the module)."""

    def __init__(
        self,
        model: LmModel,
        *,
        batch_size: int = 8,
        seq_len: int | None = None,
        pack: bool | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.batch_size = batch_size
        self.seq_len = seq_len or model.config.seq_len
        if self.seq_len > model.config.seq_len:
            raise ValueError(f"seq_len {self.seq_len} > the model's {model.config.seq_len}")
        self.pack = (not has_absolute_positions(model)) if pack is None else pack

    def score(
        self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), is greedy)`` for each ``(context,
        continuation)``; the context keeps its last tokens when both do not fit in
        ``seq_len + 1`` tokens. An empty context must be given as a prefix token."""
        pieces = [self._piece(i, list(c), list(t)) for i, (c, t) in enumerate(requests)]
        rows = self._pack(pieces)
        out: list[tuple[float, bool]] = [(0.0, True)] * len(pieces)
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            tokens, segments, targets = (
                np.zeros((self.batch_size, self.seq_len), np.int32) for _ in range(3)
            )
            for r, row in enumerate(batch):
                tokens[r], segments[r], targets[r] = row.tokens, row.segments, row.targets
            logp, greedy = _score_batch(self.model, tokens, segments, targets)
            logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
            for r, row in enumerate(batch):
                for index, lo, hi in row.spans:
                    out[index] = (float(logp[r, lo:hi].sum()), bool(greedy[r, lo:hi].all()))
        return out

    def _piece(self, index: int, context: list[int], continuation: list[int]) -> _Piece:
        if not context:
            raise ValueError("a request needs at least one context token (a prefix token)")
        if not continuation:
            return _Piece(index, [], 0, [])
        whole = (context + continuation)[-(self.seq_len + 1) :]
        scored = min(len(continuation), self.seq_len)
        return _Piece(index, whole[:-1], scored, whole[1:])

    def _pack(self, pieces: list[_Piece]) -> list[_Row]:
        """First fit, longest pieces first (a bounded look back over the open rows)."""
        rows: list[_Row] = []
        for piece in sorted(pieces, key=lambda p: -len(p.tokens)):
            if not piece.tokens:
                continue
            n = len(piece.tokens)
            row = None
            if self.pack:
                row = next((r for r in rows[-64:] if self.seq_len - r.used >= n), None)
            if row is None:
                row = _Row(
                    np.zeros(self.seq_len, np.int32),
                    np.zeros(self.seq_len, np.int32),
                    np.zeros(self.seq_len, np.int32),
                    0,
                    [],
                )
                rows.append(row)
            lo, hi = row.used, row.used + n
            row.tokens[lo:hi] = piece.tokens
            row.targets[lo:hi] = piece.targets
            row.segments[lo:hi] = len(row.spans) + 1  # padding stays segment 0
            row.spans.append((piece.index, hi - piece.scored, hi))
            row.used = hi
        return rows


@jax.jit
def _score_batch(model: LmModel, tokens, segments, targets):
    """Per position: log p(target) and whether the target is the argmax."""
    B = hax.Axis("batch", tokens.shape[0])
    P = hax.Axis(Position, tokens.shape[1])
    logits = model.logits(
        hax.named(tokens, (B, P)), segment_ids=hax.named(segments, (B, P))
    ).rearrange((B, P, model.Vocab))
    logits = logits.array.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return target_logp, jnp.argmax(logits, axis=-1) == targets
