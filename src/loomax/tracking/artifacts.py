"""Writing an artifact (``trainer.write_artifact``) to a file before a tracker logs it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def write_file(path: Path, obj: Any) -> None:
    """``str``/``bytes`` as they are, an existing file or directory copied, anything else as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(obj, bytes):
        path.write_bytes(obj)
    elif isinstance(obj, str):
        path.write_text(obj, encoding="utf-8")
    elif isinstance(obj, Path):
        if obj.is_dir():
            shutil.copytree(obj, path, dirs_exist_ok=True)
        else:
            shutil.copyfile(obj, path)
    else:
        path.write_text(json.dumps(obj, indent=2, default=str), encoding="utf-8")
