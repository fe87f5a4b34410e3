"""A pytest plugin that records CPU seconds per test file and per test (bench/suite_profile.py).

Load it with ``-p suite_cpu_plugin`` (``bench/`` on ``PYTHONPATH``) and ``-n 0``. CPU is
this process's and its waited-for children's (``RUSAGE_CHILDREN``: worker subprocesses,
``loomax train`` runs); daemons that outlive a test (Ray's) are not counted. A file's
figure includes its module fixtures; a test's, the fixtures it is the first to use.
"""

from __future__ import annotations

import json
import os
import resource
import time

OUT = os.environ.get("SUITE_PROFILE_OUT", "suite_profile.jsonl")
_state: dict = {}


def _cpu() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _append(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _file_done() -> None:
    if _state.get("file"):
        cpu, wall = _cpu() - _state["cpu0"], time.time() - _state["wall0"]
        _append(OUT, {"file": _state["file"], "cpu": cpu, "wall": wall})


def pytest_runtest_protocol(item, nextitem):
    if _state.get("file") != str(item.path):
        _file_done()
        _state.update(file=str(item.path), cpu0=_cpu(), wall0=time.time())
    _state["test0"] = (_cpu(), time.time())


def pytest_runtest_logfinish(nodeid, location):
    cpu0, wall0 = _state["test0"]
    _append(OUT + ".tests", {"id": nodeid, "cpu": _cpu() - cpu0, "wall": time.time() - wall0})


def pytest_sessionfinish(session):
    _file_done()
