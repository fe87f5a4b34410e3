"""Every JAX trace, lowering and XLA compile of every Python process a run starts, logged.

Put this directory first on ``PYTHONPATH`` (with ``tests/support/gc_site`` after it, whose
``sitecustomize`` this one loads, so the suite's GC settings still apply) and name a log file
in ``COMPILE_PROFILE_OUT``; each Python process appends one JSON line at exit:
``argv``, ``cpu`` (its own CPU-s), ``first_compile_cpu`` (CPU-s before its first JAX event:
start-up and imports) and ``rec``, one row per event: ``[kind, function, wall_s, cpu_s,
test]`` with kind ``T`` (jaxpr trace), ``L`` (lowering to MLIR) or ``C`` (XLA backend
compile, a persistent-cache read included), ``cpu_s`` the process's CPU over the event and
``test`` the pytest node id running (``PYTEST_CURRENT_TEST``). Processes killed by a signal
or ended by ``os._exit`` write nothing. ``bench/compile_profile.py`` summarises a log.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import resource
import sys
import time
from pathlib import Path

_GC_SITE = (
    Path(__file__).resolve().parents[2] / "tests" / "support" / "gc_site" / "sitecustomize.py"
)
if _GC_SITE.exists():
    _spec = importlib.util.spec_from_file_location("loomax_gc_site", _GC_SITE)
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

_KINDS = {
    "/jax/core/compile/backend_compile_duration": "C",
    "/jax/core/compile/jaxpr_trace_duration": "T",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "L",
}
_T0 = time.time()
_rows: list[list] = []
_starts: dict[tuple, float] = {}
_first: list[float] = []


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _started(event: str, value: float, fun_name: str | None = None, **_: object) -> None:
    if event in _KINDS:
        _starts[(event, fun_name)] = time.process_time()


def _ended(event: str, duration: float, fun_name: str | None = None, **_: object) -> None:
    if not _first:
        _first.append(_cpu())
    if event in _KINDS:
        start = _starts.pop((event, fun_name), None)
        cpu = None if start is None else round(time.process_time() - start, 4)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        _rows.append([_KINDS[event], str(fun_name)[:60], round(duration, 4), cpu, test])


class _AfterJaxMonitoring(importlib.abc.MetaPathFinder):
    """Registers the listeners once ``jax.monitoring`` is imported (never imports JAX itself)."""

    def find_spec(self, name, path, target=None):
        if name != "jax.monitoring":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.register_event_duration_secs_listener(_ended)
            module.register_scalar_listener(_started)

        spec.loader.exec_module = exec_module
        return spec


def _write() -> None:
    row = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "argv": sys.argv[:8],
        "wall": round(time.time() - _T0, 3),
        "cpu": round(_cpu(), 3),
        "first_compile_cpu": _first[0] if _first else None,
        "rec": _rows,
    }
    with open(os.environ["COMPILE_PROFILE_OUT"], "a") as f:
        f.write(json.dumps(row) + "\n")


if os.environ.get("COMPILE_PROFILE_OUT"):
    sys.meta_path.insert(0, _AfterJaxMonitoring())
    atexit.register(_write)
