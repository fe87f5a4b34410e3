"""Corpora every machine already has, so the demo and the tests need no download.

The only one is `python_stdlib`: the `.py` files of the running interpreter's standard
library. Test suites, IDLE, lib2to3 and installed packages are left out: they are shipped
separately (or not at all) by many Python distributions, and leaving them out keeps the
corpus the same on those.
"""

import os
import sysconfig
from pathlib import Path

from loomax.errors import DataSourceError

PYTHON_STDLIB = "python_stdlib"
"""Name of the corpus of the running interpreter's standard library sources."""

EMBEDDED_CORPORA = (PYTHON_STDLIB,)
"""Names accepted by `SourceConfig.embedded`."""

_EXCLUDED_DIRECTORIES = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "lib2to3"}
)


def embedded_paths(name: str) -> list[Path]:
    """The files of the embedded corpus `name`, one document each, in a stable order."""
    if name != PYTHON_STDLIB:
        raise DataSourceError(
            f"data source: unknown embedded corpus {name!r}; known: {', '.join(EMBEDDED_CORPORA)}"
        )
    return python_stdlib_paths()


def python_stdlib_paths() -> list[Path]:
    """Every `.py` file under the standard library directory, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _EXCLUDED_DIRECTORIES]
        for file_name in files:
            if file_name.endswith(".py"):
                path = Path(directory) / file_name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    return [path for _, path in found]
