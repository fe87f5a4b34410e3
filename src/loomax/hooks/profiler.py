"""Profiler: ``jax.profiler`` traces of the steps a schedule picks, in ``<run_dir>/profile``.

The schedule counts steps from 1 in cycles of ``wait + warmup + active`` steps, ``repeat``
times (0: until the run ends): a cycle waits ``wait`` steps, then traces ``warmup`` steps
(the profiler's start-up cost lands there) and the ``active`` steps after them. Each
trace is TensorBoard's (``*.xplane.pb``) and Perfetto's (``*.trace.json.gz``, whose
path is logged with how to open it) under ``steps-<first>-<last>/``; ``memory_profile`` adds a
device memory profile at the end of each cycle there. Only the listed ``processes`` trace.
JAX's Python tracer (every Python call, for host-side overhead) is off unless
``python_tracer`` asks for it: with it on, a traced step in which Python is busy (tracing or
compiling a program) writes a large trace and stops slowly (12 s for one tiny step in the
hook contract test).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

PERFETTO_UI = "https://ui.perfetto.dev"


def start_trace(directory: str | Path, *, python_tracer: bool = False) -> None:
    """``jax.profiler.start_trace`` into ``directory`` with a Perfetto trace, and JAX's Python
    tracer only when ``python_tracer`` (device and host activity are traced either way)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python_tracer else 0
    jax.profiler.start_trace(str(directory), create_perfetto_trace=True, profiler_options=options)


@hook_type("profiler")
class ProfilerHook(Hook):
    """Starts a trace after the step before a cycle's warmup is dispatched; stops it once the
    cycle's last active step is done.

    The traces go to ``directory`` (default ``<run_dir>/profile``). Open them with
    TensorBoard's profile plugin or Perfetto (``*.trace.json.gz``).
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """jax.profiler traces of the steps a schedule (wait, warmup, active, repeat) picks."""

        wait: int = 4
        """Steps of each cycle before tracing starts (the first cycle: compilation settles)."""
        warmup: int = 0
        """Traced steps before the active ones, where the profiler's start-up cost lands."""
        active: int = 3
        """Steps traced for reading in each cycle."""
        repeat: int = 1
        """Cycles traced; 0 = cycles until the run ends."""
        processes: list[int] | None = None
        """Indices of the processes that trace; null = every process."""
        memory_profile: bool = False
        """Also write a device memory profile (pprof) at the end of each traced cycle."""
        directory: str | None = None
        """Where the traces go; null = <run_dir>/profile."""
        python_tracer: bool = False
        """Also trace every Python call (host-side overhead; large traces, slow to stop)."""

        def __post_init__(self):
            self.check_positive("active")
            self.check(self.wait >= 0 and self.warmup >= 0, "wait and warmup must be >= 0")
            self.check(self.repeat >= 0, f"repeat must be >= 0, got {self.repeat}")

        @property
        def cycle(self) -> int:
            """Steps per cycle."""
            return self.wait + self.warmup + self.active

    config: Config
    every = 1

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        run_dir: str | Path | None = None,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.directory = self.output_directory(run_dir, "profile")
        processes = self.config.processes
        self.enabled = processes is None or jax.process_index() in processes
        self.active = False
        self.cycles_done = 0
        self.traced: list[tuple[int, int]] = []
        """The (first, last) steps of each trace written."""

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, run_dir=context.run_dir)

    def window(self, cycle: int) -> tuple[int, int]:
        """The first and last traced steps of cycle ``cycle`` (from 0)."""
        c = self.config
        first = cycle * c.cycle + c.wait + 1
        return first, first + c.warmup + c.active - 1

    def _cycle_starting_after(self, step: int) -> int | None:
        """The cycle whose first traced step is ``step + 1``, if one is due."""
        c = self.config
        cycle, offset = divmod(step - c.wait, c.cycle)
        if step < c.wait or offset or (c.repeat and cycle >= c.repeat):
            return None
        return cycle

    def on_train_begin(self, info: StepInfo) -> None:
        self._maybe_begin(info.step)

    def on_step(self, info: StepInfo) -> None:
        if self.active and info.step >= self._last:
            jax.block_until_ready(info.metrics)
            self._end(info.step)
        self._maybe_begin(info.step)

    def on_train_end(self, info: StepInfo) -> None:
        self._end(info.step)

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        self._end(info.step)

    def _maybe_begin(self, step: int) -> None:
        cycle = self._cycle_starting_after(step)
        if not self.enabled or self.active or cycle is None:
            return
        self._first, self._last = self.window(cycle)
        self._out = self.directory / f"steps-{self._first}-{self._last}"
        self._out.mkdir(parents=True, exist_ok=True)
        start_trace(self._out, python_tracer=self.config.python_tracer)
        self.active = True
        logger.info("profiling steps %d to %d into %s", self._first, self._last, self._out)

    def _end(self, step: int) -> None:
        if not self.active:
            return
        jax.profiler.stop_trace()
        self.active = False
        self.cycles_done += 1
        self.traced.append((self._first, min(step, self._last)))
        if self.config.memory_profile:
            path = self._out / f"memory-step-{step}.process-{jax.process_index()}.prof"
            jax.profiler.save_device_memory_profile(str(path))
        traces = sorted(self._out.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
        if traces:
            logger.info(
                "trace of steps %d-%d: open %s in %s (Open trace file), or tensorboard --logdir %s",
                self._first,
                min(step, self._last),
                traces[-1],
                PERFETTO_UI,
                self.directory,
            )


KERNEL_CATEGORIES = (
    ("attention", ("fmha", "sdpa", "flash", "attention")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "dot", "matmul", "wgmma")),
    ("copy", ("memcpy", "memset", "copy", "transpose")),
    ("collective", ("nccl", "all-reduce", "all-gather", "reduce-scatter", "all_reduce")),
)
"""Kernel categories of ``summarize_trace``, by a substring of the (lower-cased) name."""


def kernel_category(name: str) -> str:
    """The ``KERNEL_CATEGORIES`` entry a kernel or op name falls in; ``other`` (fusions) if none."""
    lowered = name.lower()
    for category, needles in KERNEL_CATEGORIES:
        if any(n in lowered for n in needles):
            return category
    return "other"


def summarize_trace(directory: str | Path, top: int = 12) -> dict[str, Any]:
    """Where the device time of the newest Perfetto trace under ``directory`` went.

    Sums the complete events of the accelerator's kernel streams (``/device:*`` processes,
    threads other than XLA's op and module lines); on CPU, of XLA's worker threads (or, where
    XLA ran the program inline, every event but Python's own frames). Returns
    ``{"busy_ms", "events", "by_category": {category: ms}, "top": [{name, ms, count,
    category}]}``: ``busy_ms`` adds up kernel time (streams running side by side count twice).
    """
    import gzip
    import json
    from collections import Counter

    traces = sorted(Path(directory).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no *.trace.json.gz under {directory}")
    with gzip.open(traces[-1], "rt") as f:
        events = json.load(f)["traceEvents"]
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    on_device = any(name.startswith("/device:") for name in processes.values())

    def counted(e) -> bool:
        process, thread = processes.get(e["pid"], ""), threads.get((e["pid"], e["tid"]), "")
        if on_device:
            return process.startswith("/device:") and not thread.startswith("XLA ")
        return thread.startswith("tf_XLA") and not e["name"].startswith("end: ")

    def host_work(e) -> bool:  # fallback: XLA ran inline on the calling thread
        return not e["name"].startswith(("$", "end: "))

    time_us, count = Counter(), Counter()
    complete = [e for e in events if e.get("ph") == "X"]
    chosen = [e for e in complete if counted(e)] or [e for e in complete if host_work(e)]
    for e in chosen:
        time_us[e["name"]] += e.get("dur", 0)
        count[e["name"]] += 1
    by_category: Counter = Counter()
    for name, us in time_us.items():
        by_category[kernel_category(name)] += us / 1e3
    return {
        "busy_ms": round(sum(time_us.values()) / 1e3, 3),
        "events": sum(count.values()),
        "by_category": {k: round(v, 3) for k, v in by_category.most_common()},
        "top": [
            {
                "name": name,
                "ms": round(us / 1e3, 3),
                "count": count[name],
                "category": kernel_category(name),
            }
            for name, us in time_us.most_common(top)
        ],
    }
