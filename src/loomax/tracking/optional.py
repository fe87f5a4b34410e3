"""Importing a tracker's optional package, with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from loomax.errors import MissingPackageError


def require(module: str, *, extra: str, tracker: str) -> ModuleType:
    """``import module``, or raise ``MissingPackageError`` saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingPackageError(
            f"trainer.tracker type: {tracker} needs the `{module.split('.')[0]}` package, which is not "
            f"installed: pip install 'loomax[{extra}]' (or pick another tracker)"
        ) from e
