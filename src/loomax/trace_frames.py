"""A per-thread stack of frames that trace-time code records into (activation statistics,
attention maxima): a caller opens a frame around the code it traces, and code deep inside
records into the innermost open frame, or does nothing when none is open."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class FrameStack:
    """Frames (dicts) opened with ``open()``; ``innermost()`` is where records go."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _frames(self) -> list[dict[str, Any]]:
        if not hasattr(self._local, "frames"):
            self._local.frames = []
        return self._local.frames

    def active(self) -> bool:
        """Whether a frame is open on this thread."""
        return bool(self._frames())

    def innermost(self) -> dict[str, Any] | None:
        """The innermost open frame, or None."""
        frames = self._frames()
        return frames[-1] if frames else None

    @contextlib.contextmanager
    def open(self) -> Iterator[dict[str, Any]]:
        """Open a new (empty) frame for the block; it is yielded, and closed after."""
        frame: dict[str, Any] = {}
        self._frames().append(frame)
        try:
            yield frame
        finally:
            self._frames().pop()
