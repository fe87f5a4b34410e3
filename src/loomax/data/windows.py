"""A token stream cut into fixed-length training windows."""

from collections.abc import Sequence

import numpy as np


class TokenWindows:
    """Non-overlapping windows of `seq_len` tokens over one flat token stream.

    The stream is the tokenized documents concatenated, each followed by EOS; window `i`
    is `tokens[i * seq_len : (i + 1) * seq_len]`, and the tokens after the last whole
    window are not used. Windows come back as fresh int32 arrays, so callers may modify
    them even when the stream is a read-only memory map.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        """Windows over `tokens`, a 1-D integer array (converted to int32 if needed)."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}"
            )
        if tokens.dtype != np.int32:
            tokens = tokens.astype(np.int32)
        self._tokens = tokens
        self._seq_len = seq_len
        num_windows = len(tokens) // seq_len
        self._windows = tokens[: num_windows * seq_len].reshape(num_windows, seq_len)

    @classmethod
    def from_documents(cls, documents: Sequence[np.ndarray], seq_len: int) -> "TokenWindows":
        """Windows over the concatenation of `documents` (each already ending in EOS)."""
        return cls(token_stream(documents), seq_len)

    @property
    def seq_len(self) -> int:
        """Tokens per window."""
        return self._seq_len

    @property
    def num_tokens(self) -> int:
        """Tokens in the whole stream, including the unused tail after the last window."""
        return len(self._tokens)

    @property
    def tokens(self) -> np.ndarray:
        """The flat token stream (read it, do not modify it)."""
        return self._tokens

    def __len__(self) -> int:
        return self._windows.shape[0]

    def __getitem__(self, index: int) -> np.ndarray:
        """Window `index` as an int32 array of shape `(seq_len,)`."""
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        return np.array(self._windows[index])

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The windows at `indices`, stacked into an int32 array of shape `(n, seq_len)`."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {indices.shape}")
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"window indices out of range for {len(self)} windows")
        return self._windows[indices]

    def __repr__(self) -> str:
        return (
            f"TokenWindows(windows={len(self)}, seq_len={self.seq_len}, tokens={self.num_tokens})"
        )


def token_stream(documents: Sequence[np.ndarray]) -> np.ndarray:
    """The int32 concatenation of tokenized `documents`, in order (empty if there are none)."""
    if not documents:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(documents).astype(np.int32, copy=False)


IN_MEMORY_BYTES = 1 << 30
"""Cache splits up to this size are read into memory once; larger ones are read per batch."""


class SplitWindows:
    """Windows of `seq_len` tokens over one split of a token cache (``TokenSplit``).

    Window `i` is tokens `[i * seq_len, (i + 1) * seq_len)` of the split's flat stream,
    as in `TokenWindows`. With `num_windows` only the first that many are used (the
    windows after them are held out for validation). A split up to `IN_MEMORY_BYTES` is
    read into memory at once; a larger one is read window by window from tensorstore
    when a batch asks for it.
    """

    def __init__(
        self,
        split,
        seq_len: int,
        in_memory_bytes: int = IN_MEMORY_BYTES,
        num_windows: int | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.split = split
        self.seq_len = seq_len
        self.num_tokens = int(split.num_tokens)
        """Tokens in the split's whole stream, including windows not used."""
        available = self.num_tokens // seq_len
        if num_windows is not None and not 0 <= num_windows <= available:
            raise ValueError(f"num_windows must be in [0, {available}], got {num_windows}")
        self._num_windows = available if num_windows is None else num_windows
        used = self._num_windows * seq_len
        self._memory = (
            TokenWindows(split.read(0, used), seq_len) if used * 4 <= in_memory_bytes else None
        )

    def __len__(self) -> int:
        return self._num_windows

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The windows at `indices`, stacked into an int32 array of shape `(n, seq_len)`."""
        if self._memory is not None:
            return self._memory.get_batch(indices)
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"window indices out of range for {len(self)} windows")
        rows = [self.split.read(i * self.seq_len, (i + 1) * self.seq_len) for i in indices]
        return (
            np.stack(rows).astype(np.int32, copy=False)
            if rows
            else np.zeros((0, self.seq_len), np.int32)
        )

    def __repr__(self) -> str:
        where = "memory" if self._memory is not None else "tensorstore"
        return f"SplitWindows(windows={len(self)}, seq_len={self.seq_len}, read from {where})"
