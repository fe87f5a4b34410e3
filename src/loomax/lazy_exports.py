"""A package's public names imported from their modules on first use, not at import.

A package whose modules pull in JAX or Ray (``loomax.data``, its token cache,
``loomax.distributed``) lists each public name's module; a process that asks for one name
imports only that name's module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: each name in
    ``exports`` (name -> module) is imported from its module when first asked for, then kept
    in the package."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value  # asked once
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
