"""Training while the token cache builds (issue 51): time to the first step, and the losses.

On a synthetic corpus of gzipped JSONL shards (the stdlib sources, repeated and shuffled,
as `bench/data.py` makes them) with a tokenizer trained beforehand, each in a fresh
process with a fresh cache folder:

1. `loomax cache`: the full build (what a run waited for before `stream_while_building`);
2. `loomax train` with no data switch (`data.stream_while_building: auto`, which streams a
   corpus this size) on an empty cache: the time until its first training step is logged
   (`metrics.jsonl`'s first `train/loss`), its losses, and the line naming its order;
3. the same `loomax train` on the cache finished by 1: its losses must be the same, bitwise.

    python bench/stream_start.py [--mb 40] [--shards 192] [--steps 30] [--workers 2]
                                 [--in-process] [--compile-cache]

With `--compile-cache`, 4. a run on the finished cache fills a JAX compilation cache (every
program compiling in 0.1 s or more), and 5. a fresh streaming run on another empty cache
takes its programs from there: a researcher's relaunch of a model already compiled
(`trainer.jax_compilation_cache_dir`). Without it every run compiles cold.

All runs join one Ray head of `--workers` CPUs that the bench starts first (`ray start`,
as the tests' shared head), so Ray's own start-up (tens of seconds on a loaded VM) is in
neither figure. With `--in-process` (for a VM too loaded for Ray to start: its raylet must
register within a fixed 30 s) no Ray at all: every build tokenizes shard by shard in its
own process, as `memory://` builds do. Times are wall clock from the process start (imports, tokenizer load,
compiling included). The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOAD_BEFORE: list[str] = []
"""/proc/loadavg's 1, 5 and 15 minute load averages when the bench started."""
PYTHON = Path(sys.executable)  # the environment running the bench (a worktree has no .venv)
LOOMAX = PYTHON.parent / "loomax"
IN_PROCESS = """
import contextlib, sys
from loomax.data.token_cache import build
build._run_on_ray = build._run_here  # shard by shard here, as memory:// builds run
build.ray_session = lambda config: contextlib.nullcontext()
from loomax.data.background_build import BackgroundBuilds
BackgroundBuilds.ensure_ray = lambda self: None
from loomax.cli import main
main(sys.argv[1:])
"""


def _load(relative: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ray_head(root: Path, cpus: int):
    """A Ray head on 127.0.0.1 of `cpus` CPUs (its process group; its address)."""
    import os

    from loomax.distributed.net import free_port

    nodes = _load("tests/support/ray_nodes.py", "ray_nodes")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(root)}
    for attempt in range(3):  # a loaded VM may keep the raylet past Ray's fixed 30 s
        try:
            process, port = nodes.start_head(root / str(attempt), env, free_port, cpus=cpus)
            return nodes, process, f"127.0.0.1:{port}"
        except nodes.NodeStartFailed:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _bench_data():
    spec = importlib.util.spec_from_file_location("bench_data", REPO / "bench" / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_gzipped_corpus(directory: Path, mb: float, shards: int) -> str:
    """`shards` .jsonl.gz files of ~`mb` MB of JSON in all; their brace URL."""
    plain = _bench_data().make_corpus(directory / "plain", mb, shards)
    for path in plain:
        with path.open("rb") as source, gzip.open(directory / f"{path.name}.gz", "wb", 6) as out:
            shutil.copyfileobj(source, out)
    shutil.rmtree(directory / "plain")
    return str(directory / f"shard_{{000..{shards - 1:03d}}}.jsonl.gz")


def config_yaml(path: Path, urls: str, tokenizer: Path, steps: int, chunk: int) -> Path:
    path.write_text(
        f"""data:
  tokenizer: {tokenizer}
  train: [{{urls: ["{urls}"]}}]
  stream_chunk_shards: {chunk}
model:
  type: gpt2
  seq_len: 128
  hidden_dim: 64
  num_layers: 2
  num_heads: 2
trainer:
  train_batch_size: 16
  num_train_steps: {steps}
  log_every: 1
  steps_per_eval: 100000
  progress_bar: false
sample:
  enabled: false
"""
    )
    return path


TIMELINE = (
    ("first log line (imports, config, Ray joined)", ""),
    ("first chunk built, training starts", "training starts on"),
    ("trainer and hooks made", "loomax.train_lm: model:"),
    ("step-0 eval done (model init, eval compiled)", "eval at step 0"),
)
"""Marks of a run's log before its first step: (what, text of the line that marks it)."""


def timeline(log: Path, started: float) -> dict[str, float]:
    """Seconds from the process start to each `TIMELINE` mark found in its log."""
    marks: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        try:
            stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
        except ValueError:
            continue
        seconds = stamp + int(line[20:23]) / 1000 - started
        for what, text in TIMELINE:
            if what not in marks and text in line:
                marks[what] = round(seconds, 2)
    return marks


def run(
    args: list[str],
    watch: Path | None = None,
    in_process: bool = False,
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Runs `loomax ARGS`; with `watch`, also the time its first `train/loss` appeared there;
    with `log`, its stderr goes there and the figures get its `timeline`; `env` is added to
    its environment."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"} | {
        "RAY_AUTH_MODE": "disabled",
        **(env or {}),
    }
    start, wall_start = time.perf_counter(), time.time()
    command = [str(PYTHON), "-c", IN_PROCESS] if in_process else [str(LOOMAX)]
    stderr = log.open("w") if log is not None else None
    process = subprocess.Popen([*command, *args], stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    first = None
    while process.poll() is None:
        if first is None and watch is not None and watch.exists():
            if any("train/loss" in line for line in watch.read_text().splitlines()):
                first = time.perf_counter() - start
        time.sleep(0.05)
    if stderr is not None:
        stderr.close()
    if process.returncode:
        tail = log.read_text()[-3000:] if log is not None else ""
        raise RuntimeError(f"loomax {' '.join(args)} failed with {process.returncode}\n{tail}")
    figures = {"seconds": time.perf_counter() - start, "first_step_seconds": first}
    if log is not None:
        figures["timeline"] = timeline(log, wall_start) | {"first train/loss logged": first}
    return figures


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=40.0, help="MB of JSON before gzip")
    parser.add_argument("--shards", type=int, default=192)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2, help="Ray CPUs")
    parser.add_argument("--chunk", type=int, default=8, help="data.stream_chunk_shards")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--in-process", action="store_true", help="no Ray: builds in-process")
    parser.add_argument("--cpu", default="", help="the CPU as the README names it (in the JSON)")
    parser.add_argument(
        "--compile-cache",
        action="store_true",
        help="also a fresh run whose programs come from a JAX compilation cache filled by a run before",
    )
    options = parser.parse_args()
    LOAD_BEFORE[:] = Path("/proc/loadavg").read_text().split()[:3]
    work = Path(tempfile.mkdtemp(prefix="loomax-stream-bench-"))
    ray_root = Path(tempfile.mkdtemp(prefix="lxsb", dir="/tmp"))  # Ray's socket paths: short
    head = None
    try:
        if not options.in_process:
            nodes, head, address = ray_head(ray_root, options.workers)
        urls = make_gzipped_corpus(work / "corpus", options.mb, options.shards)
        gz_mb = sum(p.stat().st_size for p in (work / "corpus").iterdir()) / 1e6
        tokenizer = _bench_data().train_tokenizer(work / "tokenizer.json", options.vocab)
        config = config_yaml(work / "run.yaml", urls, tokenizer, options.steps, options.chunk)
        common = ["--config_path", str(config)]
        if not options.in_process:
            common += ["--trainer.ray.address", address]

        def cache_dir(name: str) -> list[str]:
            return ["--data.cache_dir", str(work / name)]

        def train(name: str, cache: str, env: dict[str, str] | None = None) -> dict:
            run_dir = work / name
            figures = run(
                ["train", *common, *cache_dir(cache), "--trainer.run_dir", str(run_dir)],
                watch=run_dir / "metrics.jsonl",
                in_process=options.in_process,
                log=work / f"{name}.log",
                env=env,
            )
            return {**figures, "losses": losses(run_dir)}

        build = run(["cache", *common, *cache_dir("finished")], in_process=options.in_process)
        fresh = train("fresh", "fresh")
        finished = train("on_finished", "finished")
        # issue 61's goal: the fresh run's first step within 25% of the build plus the run's
        # own start-up (its first step on the finished cache)
        bound = 0.25 * build["seconds"] + finished["first_step_seconds"]
        result = {
            "corpus": {"shards": options.shards, "json_mb": options.mb, "gzipped_mb": gz_mb},
            "data_order_line": next(
                (
                    line[line.index("data order") :]
                    for line in (work / "fresh.log").read_text().splitlines()
                    if "data order" in line
                ),
                None,
            ),
            "goal_bound_seconds": bound,
            "goal_met": fresh["first_step_seconds"] <= bound,
            "workers": 0 if options.in_process else options.workers,
            "stream_chunk_shards": options.chunk,
            "cache_build_seconds": build["seconds"],
            "fresh_first_step_seconds": fresh["first_step_seconds"],
            "first_step_over_build": fresh["first_step_seconds"] / build["seconds"],
            "fresh_run_seconds": fresh["seconds"],
            "finished_first_step_seconds": finished["first_step_seconds"],
            "steps": options.steps,
            "same_losses": fresh["losses"] == finished["losses"],
            "fresh_timeline_s": fresh["timeline"],
            "finished_timeline_s": finished["timeline"],
            "load_average_before": LOAD_BEFORE,
            "cpu": options.cpu,
            "losses_fresh_last": fresh["losses"][-1],
            "losses_finished_last": finished["losses"][-1],
        }
        if options.compile_cache:  # every program of 0.1 s or more kept; a run fills it first
            warm = {
                "JAX_COMPILATION_CACHE_DIR": str(work / "jax_cache"),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1",
            }
            train("fills_compile_cache", "finished", env=warm)
            fresh_warm = train("fresh_warm", "fresh_warm", env=warm)
            result["warm_compile_cache"] = {
                "fresh_first_step_seconds": fresh_warm["first_step_seconds"],
                "first_step_over_build": fresh_warm["first_step_seconds"] / build["seconds"],
                "same_losses": fresh_warm["losses"] == finished["losses"],
                "fresh_timeline_s": fresh_warm["timeline"],
            }
        print(
            f"{options.shards} shards, {gz_mb:.1f} MB gzipped: `loomax cache` {build['seconds']:.1f} s; "
            f"fresh streaming run's first step at {fresh['first_step_seconds']:.1f} s "
            f"({result['first_step_over_build']:.0%} of the build); on the finished cache "
            f"{finished['first_step_seconds']:.1f} s; same {options.steps} losses: "
            f"{result['same_losses']}"
        )
        if options.compile_cache:
            warm = result["warm_compile_cache"]
            print(
                f"with a warm JAX compilation cache: fresh run's first step at "
                f"{warm['fresh_first_step_seconds']:.1f} s ({warm['first_step_over_build']:.0%} "
                f"of the build); same losses: {warm['same_losses']}"
            )
        print(json.dumps(result))
    finally:
        if head is not None:
            nodes.stop_node(head)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ray_root, ignore_errors=True)


if __name__ == "__main__":
    main()
