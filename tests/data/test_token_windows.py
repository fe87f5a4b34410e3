"""Cutting a token stream into windows."""

import numpy as np
import pytest

from loomax.data import TokenWindows


def test_windows_are_the_concatenation_cut_without_remainder() -> None:
    eos = 0
    documents = [np.array([5, 6, eos]), np.array([7, eos]), np.array([8, 9, 10, eos])]
    windows = TokenWindows.from_documents(documents, seq_len=4)
    assert windows.num_tokens == 9
    assert len(windows) == 2
    assert windows[0].tolist() == [5, 6, 0, 7]
    assert windows[1].tolist() == [0, 8, 9, 10]
    assert windows[0].dtype == np.int32
    batch = windows.get_batch([1, 0, 1])
    assert batch.dtype == np.int32
    assert batch.tolist() == [[0, 8, 9, 10], [5, 6, 0, 7], [0, 8, 9, 10]]


def test_windows_are_copies() -> None:
    tokens = np.arange(8, dtype=np.int32)
    windows = TokenWindows(tokens, seq_len=4)
    windows[0][:] = -1
    windows.get_batch([0])[:] = -1
    assert tokens.tolist() == list(range(8))


def test_out_of_range_and_bad_inputs() -> None:
    windows = TokenWindows(np.arange(10), seq_len=3)
    assert len(windows) == 3
    with pytest.raises(IndexError):
        windows[3]
    with pytest.raises(IndexError):
        windows.get_batch([0, -1])
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindows(np.arange(10), seq_len=0)
    with pytest.raises(ValueError, match="1-D integer"):
        TokenWindows(np.zeros((2, 2), dtype=np.int32), seq_len=2)


def test_too_short_stream_has_no_windows() -> None:
    windows = TokenWindows.from_documents([np.array([1, 0])], seq_len=4)
    assert len(windows) == 0
    assert windows.num_tokens == 2
    assert len(TokenWindows.from_documents([], seq_len=4)) == 0
