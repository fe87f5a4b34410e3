"""The ``tiny`` fixture: one tiny trainer setup (tests/train/tiny_setup.py) for hook tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "loomax_tests_tiny_setup", Path(__file__).resolve().parents[1] / "train" / "tiny_setup.py"
)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)


@pytest.fixture(scope="session")
def tiny():
    return _module.Tiny
