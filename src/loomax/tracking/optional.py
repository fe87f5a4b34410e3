"""Importing a tracker's optional package, with an error that names the extra to install."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from loomax.errors import MissingPackageError


def _missing(module: str, extra: str, tracker: str) -> MissingPackageError:
    return MissingPackageError(
        f"trainer.tracker type: {tracker} needs the `{module.split('.')[0]}` package, which is not "
        f"installed: pip install 'loomax[{extra}]' (or pick another tracker)"
    )


def require(module: str, *, extra: str, tracker: str) -> ModuleType:
    """``import module``, or raise ``MissingPackageError`` saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _missing(module, extra, tracker) from e


def check_installed(module: str, *, extra: str, tracker: str) -> None:
    """Raise ``MissingPackageError`` (as ``require``) unless ``module``'s top-level package is
    installed; imports nothing, so a run can check its trackers before any expensive work."""
    top = module.split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise _missing(module, extra, tracker)
