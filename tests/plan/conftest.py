"""Compile-for-TPU tests need libtpu (the `test` extra brings it); without it they skip."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "libtpu", reason="compiling for TPU topologies needs libtpu: pip install -e '.[test]'"
)
