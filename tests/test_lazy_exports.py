"""loomax.lazy_exports: a package's names imported from their modules on first use."""

from __future__ import annotations

import sys
import types

import pytest

from loomax.lazy_exports import lazy_exports


def test_a_name_is_imported_on_first_use_kept_and_listed(monkeypatch):
    package = types.ModuleType("lazy_pkg")
    monkeypatch.setitem(sys.modules, "lazy_pkg", package)
    package.__getattr__, package.__dir__ = lazy_exports("lazy_pkg", {"sqrt": "math"})
    assert "sqrt" not in vars(package)
    import math

    assert package.sqrt is math.sqrt
    assert vars(package)["sqrt"] is math.sqrt  # kept: __getattr__ is not asked again
    assert "sqrt" in dir(package)
    with pytest.raises(AttributeError, match="'lazy_pkg' has no attribute 'cos'"):
        package.cos  # noqa: B018
