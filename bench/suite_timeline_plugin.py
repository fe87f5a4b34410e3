"""A pytest plugin that records, per xdist worker, when each test file ran (bench/suite_file_costs.py).

Load it with ``-p suite_timeline_plugin`` (``bench/`` on ``PYTHONPATH``), under ``-n 2`` as
``make test`` runs: one row per test file, ``{"w": worker, "file", "t0", "t1", "cpu"}``,
appended to ``$SUITE_TIMELINE_OUT``. CPU is the worker's own and its waited-for children's.
"""

from __future__ import annotations

import json
import os
import time

from suite_cpu_plugin import _cpu  # this process's CPU and its waited-for children's

OUT = os.environ.get("SUITE_TIMELINE_OUT", "suite_timeline.jsonl")
_state: dict = {}


def _file_done() -> None:
    if _state.get("file"):
        row = {
            "w": os.environ.get("PYTEST_XDIST_WORKER", "-"),
            "file": _state["file"],
            "t0": _state["t0"],
            "t1": time.time(),
            "cpu": _cpu() - _state["cpu0"],
        }
        with open(OUT, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_runtest_protocol(item, nextitem):
    if _state.get("file") != str(item.path):
        _file_done()
        _state.update(file=str(item.path), t0=time.time(), cpu0=_cpu())


def pytest_sessionfinish(session):
    _file_done()
    _state.clear()
