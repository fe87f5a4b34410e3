"""Packing: deterministic first-fit / best-fit rows, weights shifted to the predicting position."""

from __future__ import annotations

import numpy as np
import pytest

from loomax.data.chat.packing import (
    SEGMENTS,
    TOKENS,
    WEIGHTS,
    assign_rows,
    conversation_weights,
    pack_rows,
)


def test_first_fit_and_best_fit_rows():
    lengths = [6, 5, 3, 4, 2]
    assert assign_rows(lengths, 10, "first_fit") == [[0, 2], [1, 3], [4]]
    # best fit: 3 goes where it leaves least room (row of 6 leaves 4 < row of 5's 5)...
    assert assign_rows(lengths, 10, "best_fit") == [[0, 2], [1, 3], [4]]
    # ...and 2 to the fuller of the rows with room
    assert assign_rows([5, 7, 2], 10, "best_fit") == [[0], [1, 2]]
    assert assign_rows([5, 7, 2], 10, "first_fit") == [[0, 2], [1]]
    assert assign_rows(lengths, 10, "none") == [[0], [1], [2], [3], [4]]
    assert assign_rows(lengths, 10) == assign_rows(list(lengths), 10)  # deterministic
    with pytest.raises(ValueError, match="conversation 1 has 11 tokens"):
        assign_rows([3, 11], 10)


def test_weights_mark_the_position_that_predicts_a_trained_token():
    trained = np.array([0, 0, 1, 1, 0, 1], dtype=bool)
    assert conversation_weights(trained).tolist() == [0, 1, 1, 0, 1, 0]


def test_pack_rows_lays_out_tokens_weights_and_segments():
    a = (np.array([1, 2, 3]), np.array([0, 1, 1], dtype=bool))
    b = (np.array([4, 5]), np.array([0, 1], dtype=bool))
    rows = pack_rows([a, b], [[0, 1]], 6, pad_id=9)
    assert rows.shape == (1, 3, 6) and rows.dtype == np.int32
    assert rows[0, TOKENS].tolist() == [1, 2, 3, 4, 5, 9]
    # a's last token predicts nothing (b's first token is another conversation)
    assert rows[0, WEIGHTS].tolist() == [1, 1, 0, 1, 0, 0]
    assert rows[0, SEGMENTS].tolist() == [0, 0, 0, 1, 1, -1]
