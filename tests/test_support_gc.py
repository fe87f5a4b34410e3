"""The test processes, and the Python processes they start, collect cyclic garbage less often
(tests/support/gc_site/sitecustomize.py, applied by tests/conftest.py)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

THRESHOLDS = (50_000, 20, 100)


def test_this_process_has_the_thresholds():
    assert gc.get_threshold() == THRESHOLDS


@pytest.mark.parametrize("inherit", [True, False])
def test_a_started_process_has_them_with_the_tests_environment(inherit):
    env = (
        dict(os.environ) if inherit else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    )
    out = subprocess.run(
        [sys.executable, "-c", "import gc; print(gc.get_threshold())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (out.strip() == str(THRESHOLDS)) == inherit, out
