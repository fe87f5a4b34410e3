"""Local files replaced whole: written aside, then renamed over the old one.

A reader (another process polling the run directory, or the next run after a crash) sees
either the old file or the complete new one, never an empty or half-written file.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


def replace_path(path: str | os.PathLike, write_to: Callable[[Path], None]) -> None:
    """Have ``write_to(temp_path)`` write the new file, then rename it to ``path``.

    The temporary file sits beside ``path`` (same file system, so the rename is atomic) and
    is removed if ``write_to`` fails, leaving ``path`` as it was.
    """
    path = Path(path)
    # random, not pid-based: a restarted job often gets its killed predecessor's pid (and
    # main-thread id), and the temp that one left behind must not block the next write
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    try:
        write_to(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_file(
    path: str | os.PathLike, write: Callable[[TextIO], None], *, mode: int = 0o666
) -> None:
    """Replace the text file ``path`` with what ``write(f)`` writes to ``f``.

    The new file is created with permission bits ``mode`` (less the umask): give
    ``0o600`` for a file only its owner may read.
    """

    def write_to(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)

    replace_path(path, write_to)


def replace_text(path: str | os.PathLike, text: str, *, mode: int = 0o666) -> None:
    """Replace the text file ``path`` with ``text`` (see ``replace_file``)."""
    replace_file(path, lambda f: f.write(text), mode=mode)
