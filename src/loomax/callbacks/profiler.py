"""Profiler: a ``jax.profiler`` trace of steps [start, start + num_steps) in ``<run_dir>/profile``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)


@hook_type("profiler")
class ProfilerHook(Hook):
    """Starts the trace after step ``start - 1`` is dispatched; stops once step ``start + num_steps - 1`` is done.

    The trace goes to ``directory`` (default ``<run_dir>/profile``). Open it with
    TensorBoard's profile plugin or Perfetto (``*.trace.json.gz``).
    """

    @dataclass(frozen=True)
    class Config(HookConfig):
        """A jax.profiler trace of steps [start, start + num_steps) into <run_dir>/profile."""

        start: int = 5
        """First step traced (after compilation has settled)."""
        num_steps: int = 3
        """Steps traced."""
        directory: str | None = None
        """Where the trace goes; null = <run_dir>/profile."""

        def __post_init__(self):
            self.check_positive("start", "num_steps")

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
        if self.config.directory is None and run_dir is None:
            raise ValueError("ProfilerHook needs a directory or a run_dir")
        directory = self.config.directory
        self.directory = Path(directory) if directory else Path(run_dir) / "profile"
        self.active = False
        self.done = False

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, run_dir=context.run_dir)

    @property
    def last_step(self) -> int:
        """The last step traced."""
        return self.config.start + self.config.num_steps - 1

    def on_train_begin(self, info: StepInfo) -> None:
        if info.step == self.config.start - 1:
            self._begin()

    def on_step(self, info: StepInfo) -> None:
        if info.step == self.config.start - 1 and not self.done:
            self._begin()
        elif self.active and info.step >= self.last_step:
            jax.block_until_ready(info.metrics)
            self._end()

    def on_train_end(self, info: StepInfo) -> None:
        self._end()

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        self._end()

    def _begin(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self.active = True
        logger.info(
            "profiling steps %d to %d into %s",
            self.config.start,
            self.last_step,
            self.directory,
        )

    def _end(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active, self.done = False, True


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
