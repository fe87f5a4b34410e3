"""Data pipeline benchmarks (figures, not tests).

1. Token-cache build throughput: `build_token_cache` on a fresh local Ray cluster of 1 and
   of 2 workers against single-process Hugging Face `datasets` baselines
   (`load_dataset("json")` then `.map(batched=True)` appending EOS: `hf` encodes with
   `Tokenizer.encode_batch`, `hf_fast` with `encode_batch_fast`, the call Loomax makes),
   on the same JSONL shards with the same tokenizer. Each build runs in a fresh process
   with `TOKENIZERS_PARALLELISM` unset and `RAYON_NUM_THREADS` as `--threads` says, in
   rounds that rotate the order; medians are reported. Every build must give the same
   tokens (a digest of the whole token stream and of the document lengths).
2. Loader throughput: `BatchLoader` batches/s (quickstart batch size and seq_len, shuffled,
   prefetch on and off) over the cache built above, in memory and read lazily from
   tensorstore, against the quickstart train step rate measured with `loomax bench`.

    python bench/data.py [--mb 40] [--shards 16] [--rounds 2] [--workers 1,2]
                         [--threads auto,1] [--baselines hf,hf_fast]
                         [--tokenizer PATH] [--skip-build] [--skip-loader]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"
LOOMAX = REPO / ".venv" / "bin" / "loomax"
QUICKSTART = REPO / "config" / "quickstart.yaml"

THREAD_ENV = ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")
"""Environment that sets how many threads `encode_batch` uses (rayon's global pool)."""


# ---------------------------------------------------------------------- corpus
def make_corpus(directory: Path, mb: float, shards: int, seed: int = 0) -> list[Path]:
    """Writes the stdlib sources, repeated and shuffled, as `shards` JSONL files of ~`mb` MB."""
    from loomax.data.embedded import python_stdlib_paths

    texts = [p.read_text(encoding="utf-8", errors="replace") for p in python_stdlib_paths()]
    lines = [json.dumps({"text": text}) + "\n" for text in texts]
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"shard_{i:03d}.jsonl" for i in range(shards)]
    files = [path.open("w", encoding="utf-8") for path in paths]
    target, written, count = int(mb * 1e6), 0, 0
    try:
        while written < target:
            order = list(range(len(lines)))
            rng.shuffle(order)
            for i in order:
                files[count % shards].write(lines[i])
                written += len(lines[i])
                count += 1
                if written >= target:
                    break
    finally:
        for file in files:
            file.close()
    return paths


def train_tokenizer(path: Path, vocab_size: int, num_docs: int = 200) -> Path:
    """A byte-level BPE of `vocab_size` trained on the first `num_docs` stdlib files."""
    from loomax.data.embedded import python_stdlib_paths
    from loomax.data.tokenizer import train_bpe_tokenizer

    files = python_stdlib_paths()[:num_docs]
    docs = (p.read_text(encoding="utf-8", errors="replace") for p in files)
    train_bpe_tokenizer(docs, vocab_size, path)
    return path


def stream_digest(tokens: Any, lengths: Any) -> str:
    """SHA-256 over the int32 token stream and the int64 document lengths."""
    import numpy as np

    digest = hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    digest.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------- one build (child process)
def build_ray(
    corpus: Path,
    tokenizer: Path,
    cache: Path,
    workers: int,
    nodes: int = 0,
    fast_encoder: bool = False,
) -> dict[str, Any]:
    """Builds the token cache on a fresh local Ray cluster of `workers` CPUs, or (`nodes`
    > 0) on a cluster of that many `ray start` nodes of 1 CPU each on this machine.

    `fast_encoder` as `data.fast_encoder: auto` (tiktoken where exact); off by default, so
    this file's figures stay those of `encode_batch_fast` they were recorded with."""
    import secrets

    if nodes:  # before Ray is imported: it reads the auth mode once
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    import numpy as np
    import ray

    from loomax.data.sources import SourceConfig, source_shards
    from loomax.data.token_cache import TokenCache, build_token_cache
    from loomax.data.token_cache import build as token_cache
    from loomax.distributed import RayConfig, init_ray

    phases = _time_phases(token_cache, ("_tokenize_missing", "_finish"))
    started: list[subprocess.Popen] = []
    temp = Path(tempfile.mkdtemp(prefix="lxb-"))  # short: Ray's socket paths live under it
    try:
        start = time.perf_counter()
        if nodes:
            address = start_nodes(nodes, temp, started)
            config = RayConfig(address=address)
        else:
            config = RayConfig(num_cpus=workers)
        init_ray(config)
        startup_s = time.perf_counter() - start
        shards = source_shards(SourceConfig(urls=[str(corpus / "*.jsonl*")]))  # plain or .gz
        start = time.perf_counter()
        info = build_token_cache(
            shards,
            tokenizer,
            cache,
            ray_config=config,
            progress=False,
            overwrite=True,
            fast_encoder=fast_encoder,
        )
        build_s = time.perf_counter() - start
        ray.shutdown()
    finally:
        for proc in reversed(started):
            stop_node(proc)
        shutil.rmtree(temp, ignore_errors=True)
    split = TokenCache.open(cache)["train"]
    return {
        "startup_s": startup_s,
        "build_s": build_s,
        "tokenize_s": phases["_tokenize_missing"],
        "assemble_s": phases["_finish"],
        "tokens": info.splits["train"].tokens,
        "documents": info.splits["train"].documents,
        "digest": stream_digest(split.as_numpy(), np.diff(split.offsets())),
        "cache_url": info.url,
        "nodes_used": len(info.nodes),
    }


def start_nodes(count: int, temp: Path, started: list[subprocess.Popen]) -> str:
    """Starts a head and `count - 1` worker nodes (`ray start`, 1 CPU each) on 127.0.0.1,
    appending each to `started`; returns the head's address. The nodes inherit this
    process's environment (its `RAY_AUTH_*`)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for node in range(count):
        role = ["--head", f"--port={port}", "--include-dashboard=false"] if node == 0 else []
        role = role or [f"--address=127.0.0.1:{port}"]
        argv = [str(PYTHON.with_name("ray")), "start", "--block", "--disable-usage-stats"]
        argv += ["--num-cpus=1", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}/{node}", *role]
        log = temp / f"node{node}.log"
        with log.open("w") as out:
            started.append(
                subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            )
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            if started[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start {role} failed:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)
    return f"127.0.0.1:{port}"


def stop_node(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to a `ray start` node's process group."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _time_phases(module: Any, names: tuple[str, ...]) -> dict[str, float]:
    """Wraps `module`'s functions `names` (in this process only) to record their seconds."""
    seconds = dict.fromkeys(names, 0.0)

    def timed(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        return wrapper

    for name in names:
        setattr(module, name, timed(name, getattr(module, name)))
    return seconds


def build_hf(
    corpus: Path,
    tokenizer_path: Path,
    scratch: Path,
    fast: bool,
    num_proc: int = 1,
    tiktoken: bool = False,
) -> dict[str, Any]:
    """`load_dataset("json")` then a batched `.map` (``num_proc`` processes) that encodes +
    appends EOS.

    `encode_batch` by default; `encode_batch_fast` (no character offsets, what Loomax's
    `encode_documents` calls) with `fast`; Loomax's exact tiktoken encoder
    (`loomax.data.fast_encoder`, made once per process) with `tiktoken`.
    """
    import datasets
    from tokenizers import Tokenizer

    from loomax.data.fast_encoder import fast_encoder
    from loomax.data.tokenizer import eos_id

    datasets.disable_progress_bars()
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = [eos_id(tokenizer)]
    encode = tokenizer.encode_batch_fast if fast else tokenizer.encode_batch
    if tiktoken and fast_encoder(tokenizer) is None:
        raise RuntimeError(f"{tokenizer_path}: no exact fast encoder (see its debug log)")

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        if tiktoken:  # in each map process: converted once there (cached), like a Ray worker
            return {
                "input_ids": [
                    ids + eos for ids in fast_encoder(tokenizer).encode_batch(batch["text"])
                ]
            }
        return {"input_ids": [e.ids + eos for e in encode(batch["text"])]}

    files = [str(p) for p in sorted(corpus.glob("*.jsonl*"))]  # plain or .gz
    start = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=files, split="train", cache_dir=scratch)
    load_s = time.perf_counter() - start
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    start = time.perf_counter()
    out = dataset.map(
        tokenize,
        batched=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=["text"],
        features=features,
    )
    return map_result(out, load_s, time.perf_counter() - start)


def map_result(out, load_s: float, map_s: float) -> dict:
    """A ``datasets.map`` build's figures: times, tokens, documents and the token digest."""
    import numpy as np
    import pyarrow.compute as pc

    column = out.data.column("input_ids").combine_chunks()
    tokens = column.flatten().to_numpy()
    lengths = pc.list_value_length(column).to_numpy()
    return {
        "load_s": load_s,
        "map_s": map_s,
        "build_s": load_s + map_s,
        "tokens": int(len(tokens)),
        "documents": len(out),
        "digest": stream_digest(tokens, np.asarray(lengths)),
    }


def child_main(args: argparse.Namespace) -> None:
    """Runs one build in this (fresh) process and prints its figures as a JSON line."""
    corpus, tokenizer, out = Path(args.corpus), Path(args.tokenizer), Path(args.out)
    if args.child.startswith("hf"):
        result = build_hf(corpus, tokenizer, out, fast=args.child == "hf_fast")
    elif args.child.startswith("node"):
        result = build_ray(corpus, tokenizer, out, 0, nodes=int(args.child.removeprefix("node")))
    else:
        result = build_ray(corpus, tokenizer, out, int(args.child.removeprefix("ray")))
    print(json.dumps(result))


# ---------------------------------------------------------------------- part 1: cache build
def busy_cpus(seconds: float = 1.0) -> float | None:
    """CPUs busy (from /proc/stat) over `seconds` while this benchmark idles: outside load."""

    def snapshot() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:9]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    try:
        total, idle = snapshot()
        time.sleep(seconds)
        total2, idle2 = snapshot()
    except OSError:
        return None
    return round((1 - (idle2 - idle) / max(total2 - total, 1)) * (os.cpu_count() or 1), 2)


def thread_env(threads: str) -> dict[str, str]:
    """The environment of a build: `auto` leaves rayon's default (all cores), N pins it."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if threads != "auto":
        env["RAYON_NUM_THREADS"] = threads
    return env


def spawn_build(kind: str, corpus: Path, tokenizer: Path, out: Path, threads: str) -> dict:
    """Runs `kind` (`hf`, `hf_fast`, `ray<N>` or `node<N>`) in a child process: its figures, and the
    CPUs busy just before it."""
    command = [str(PYTHON), __file__, "--child", kind, "--corpus", str(corpus)]
    command += ["--tokenizer", str(tokenizer), "--out", str(out)]
    busy = busy_cpus()
    proc = subprocess.run(command, env=thread_env(threads), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} build failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["busy_before"] = busy
    return result


def build_benchmark(
    corpus: Path,
    tokenizer: Path,
    scratch: Path,
    kinds: list[str],
    rounds: int,
    threads: str,
) -> tuple[dict[str, Any], str]:
    """Alternating rounds of every kind of build; medians, ratios, and the cache of the
    first run of the last Ray kind (kept for the loader benchmark)."""
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    keep = [k for k in kinds if not k.startswith("hf")][-1:]
    keep_url = ""
    for r in range(rounds):
        shift = r % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:  # rotate the order each round
            out = scratch / f"rayon{threads}-{kind}-{r}"
            result = spawn_build(kind, corpus, tokenizer, out, threads)
            runs[kind].append(result)
            print(f"  RAYON_NUM_THREADS={threads} round {r} {kind:7s} {_describe(result)}")
            if kind in keep and not keep_url:
                keep_url = result["cache_url"]
            else:
                shutil.rmtree(out, ignore_errors=True)
    return _summarise(runs), keep_url


def _describe(result: dict) -> str:
    if "map_s" in result:
        extra = f"load {result['load_s']:.1f}s + map {result['map_s']:.1f}s"
    else:
        extra = (
            f"tokenize {result['tokenize_s']:.1f}s + assemble {result['assemble_s']:.1f}s; "
            f"cluster start {result['startup_s']:.1f}s; {result['nodes_used']} node(s) worked"
        )
    return (
        f"{result['tokens'] / result['build_s'] / 1e6:5.2f} M tok/s: {result['tokens']:,} "
        f"tokens in {result['build_s']:.1f}s ({extra}; busy before: {result['busy_before']})"
    )


def _median(results: list[dict], *keys: str) -> float:
    return statistics.median(sum(r[k] for k in keys) for r in results)


def _summarise(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Median seconds and tokens/s per kind, ratios to the baselines, and the token check."""
    out: dict[str, Any] = {}
    for kind, results in runs.items():
        tokens = results[0]["tokens"]
        build_s = _median(results, "build_s")
        entry: dict[str, Any] = {
            "tokens": tokens,
            "documents": results[0]["documents"],
            "build_s": round(build_s, 2),
            "tokens_per_s": round(tokens / build_s),
        }
        phases = ("load_s", "map_s") if kind.startswith("hf") else ("tokenize_s", "assemble_s")
        for phase in phases + (() if kind.startswith("hf") else ("startup_s",)):
            entry[phase] = round(_median(results, phase), 2)
        if not kind.startswith("hf"):
            with_startup = _median(results, "startup_s", "build_s")
            entry["tokens_per_s_with_startup"] = round(tokens / with_startup)
        out[kind] = entry
    baselines = [k for k in out if k.startswith("hf")]
    for kind, entry in out.items():
        if not kind.startswith("hf"):
            for base in baselines:
                rate = out[base]["tokens_per_s"]
                entry[f"vs_{base}"] = round(entry["tokens_per_s"] / rate, 2)
                entry[f"vs_{base}_with_startup"] = round(
                    entry["tokens_per_s_with_startup"] / rate, 2
                )
    for prefix in ("ray", "node"):  # each against the smallest of its kind
        group = sorted(
            (k for k in out if k.startswith(prefix)), key=lambda k: int(k[len(prefix) :])
        )
        for kind in group[1:]:
            out[kind][f"vs_{group[0]}"] = round(
                out[kind]["tokens_per_s"] / out[group[0]]["tokens_per_s"], 2
            )
    for kind in (k for k in out if k.startswith("node")):  # nodes that tokenized a shard
        out[kind]["nodes_used"] = min(r["nodes_used"] for r in runs[kind])
    every = [r for results in runs.values() for r in results]
    out["same_tokens"] = len({(r["digest"], r["tokens"], r["documents"]) for r in every}) == 1
    busy = [r["busy_before"] for r in every if r["busy_before"] is not None]
    out["busy_before_max"] = max(busy, default=None)
    return out


def print_build_table(threads: str, summary: dict[str, Any]) -> None:
    kinds = [k for k in summary if isinstance(summary[k], dict)]
    baselines = [k for k in kinds if k.startswith("hf")]
    print(f"\ncache build, RAYON_NUM_THREADS={threads}: medians")
    header = f"  {'':8s} {'build s':>8s} {'M tok/s':>8s}"
    header += "".join(f" {'vs ' + b:>11s}" for b in baselines)
    print(header + "   details")
    for kind in kinds:
        entry = summary[kind]
        line = f"  {kind:8s} {entry['build_s']:8.2f} {entry['tokens_per_s'] / 1e6:8.2f}"
        if kind.startswith("hf"):
            line += " " * 12 * len(baselines)
            line += f"   load {entry['load_s']:.2f}s + map {entry['map_s']:.2f}s"
        else:
            line += "".join(f" {entry[f'vs_{b}']:10.2f}x" for b in baselines)
            with_start = ", ".join(f"{entry[f'vs_{b}_with_startup']:.2f}x" for b in baselines)
            line += (
                f"   tokenize {entry['tokenize_s']:.2f}s + assemble {entry['assemble_s']:.2f}s;"
                f" +{entry['startup_s']:.1f}s cluster start: {with_start}"
            )
            scaling = [k for k in entry if k.startswith(("vs_ray", "vs_node"))]
            line += "".join(f"; {entry[k]:.2f}x {k.removeprefix('vs_')}" for k in scaling)
        print(line)
    print(f"  same tokens (whole stream and document lengths): {summary['same_tokens']}")
    print(f"  most CPUs busy in the 1 s before a run: {summary['busy_before_max']}", flush=True)


# ---------------------------------------------------------------------- part 2: loader
class LazyWindows:
    """Windows read from the cache's tensorstore array one by one (nothing held in memory)."""

    def __init__(self, split: Any, seq_len: int) -> None:
        self.split = split
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.split.num_tokens // self.seq_len

    def get_batch(self, indices: Any) -> Any:
        import numpy as np

        n = self.seq_len
        return np.stack([self.split.read(int(i) * n, (int(i) + 1) * n) for i in indices])


def loader_rate(windows: Any, batch_size: int, prefetch: int, batches: int) -> float:
    """Batches/s of a shuffled `BatchLoader` over `windows`, after a few untimed batches."""
    from loomax.data.loader import BatchLoader

    loader = BatchLoader(windows, batch_size, seed=0, shuffle=True, prefetch=prefetch)
    iterator = loader.iter_from(0)
    for _ in range(5):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
    elapsed = time.perf_counter() - start
    assert batch.shape == (batch_size, windows.seq_len), batch.shape
    if hasattr(iterator, "close"):
        iterator.close()
    return batches / elapsed


def quickstart_step(steps: int) -> dict[str, Any]:
    """`loomax bench` on the quickstart config (vocab 4096, as the quickstart tokenizer)."""
    command = [str(LOOMAX), "bench", "--config_path", str(QUICKSTART)]
    command += ["--model.vocab_size", "4096", "--steps", str(steps)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"loomax bench failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def loader_benchmark(cache_url: str, batches: int, lazy_batches: int, steps: int) -> dict:
    """Loader batches/s (in memory and lazy; prefetch 2 and 0) against the quickstart step rate."""
    from loomax.config import parse_config
    from loomax.data.token_cache import TokenCache
    from loomax.data.windows import TokenWindows
    from loomax.lm import TrainLmConfig

    config = parse_config(TrainLmConfig, QUICKSTART, [])
    batch_size, seq_len = config.trainer.train_batch_size, config.model.seq_len
    split = TokenCache.open(cache_url)["train"]
    variants = {
        "memory": (TokenWindows(split.as_numpy(), seq_len), batches),
        "lazy": (LazyWindows(split, seq_len), lazy_batches),
    }
    result: dict[str, Any] = {"batch_size": batch_size, "seq_len": seq_len}
    result["busy_before"] = busy_cpus()
    for name, (windows, n) in variants.items():
        for prefetch in (2, 0):
            rate = loader_rate(windows, batch_size, prefetch, n)
            result[f"{name}_prefetch{prefetch}_batches_per_s"] = round(rate, 1)
            print(f"  loader {name:6s} prefetch={prefetch}: {rate:9.1f} batches/s ({n} batches)")
    bench = quickstart_step(steps)
    steps_per_s = 1e3 / bench["step_ms_median"]
    result["quickstart_step_ms_median"] = bench["step_ms_median"]
    result["quickstart_steps_per_s"] = round(steps_per_s, 2)
    print(f"  quickstart step: {bench['step_ms_median']} ms median = {steps_per_s:.1f} steps/s")
    for key in [k for k in result if k.endswith("_batches_per_s")]:
        ratio = result[key] / steps_per_s
        result[key.replace("_batches_per_s", "_vs_step")] = round(ratio, 1)
        print(f"  {key.removesuffix('_batches_per_s'):18s} / steps/s = {ratio:8.1f}x")
    return result


# ---------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=40.0, help="corpus size in MB of JSONL")
    parser.add_argument("--shards", type=int, default=16, help="JSONL files")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every build")
    parser.add_argument("--workers", default="1,2", help="Ray worker counts (num_cpus)")
    parser.add_argument(
        "--nodes", default="1,2", help="`ray start` node counts (1 CPU each); empty: none"
    )
    parser.add_argument(
        "--baselines", default="hf,hf_fast", help="hf (encode_batch), hf_fast (encode_batch_fast)"
    )
    parser.add_argument(
        "--threads",
        default="auto,1",
        help="RAYON_NUM_THREADS settings to run the builds under, e.g. auto,1 (auto: unset)",
    )
    parser.add_argument("--tokenizer", help="tokenizer.json (default: train an 8192 BPE)")
    parser.add_argument("--batches", type=int, default=500, help="loader batches timed")
    parser.add_argument("--lazy-batches", type=int, default=200, help="lazy loader batches")
    parser.add_argument("--steps", type=int, default=20, help="quickstart steps timed")
    parser.add_argument("--skip-build", action="store_true", help="no build comparison")
    parser.add_argument("--skip-loader", action="store_true", help="no loader benchmark")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    for name in ("--child", "--corpus", "--out"):  # internal: one build in a child process
        parser.add_argument(name, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args)
        return
    began = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="loomax-bench-data-"))
    figures: dict[str, Any] = {"cpus": os.cpu_count(), "busy_cpus_start": busy_cpus()}
    try:
        corpus = scratch / "corpus"
        paths = make_corpus(corpus, args.mb, args.shards)
        figures["corpus_mb"] = round(sum(p.stat().st_size for p in paths) / 1e6, 1)
        figures["shards"] = len(paths)
        start = time.perf_counter()
        tokenizer = Path(args.tokenizer) if args.tokenizer else None
        if tokenizer is None:
            tokenizer = train_tokenizer(scratch / "tokenizer.json", 8192)
        figures["tokenizer"] = "given" if args.tokenizer else "bpe-8192 (trained)"
        print(
            f"corpus: {figures['corpus_mb']} MB in {len(paths)} JSONL shards; tokenizer "
            f"{figures['tokenizer']} ({time.perf_counter() - start:.1f}s); builds run with "
            "TOKENIZERS_PARALLELISM unset, RAYON_NUM_THREADS per --threads",
            flush=True,
        )
        kinds = [f"ray{int(w)}" for w in args.workers.split(",") if w]
        kinds += [f"node{int(n)}" for n in args.nodes.split(",") if n]
        kinds += args.baselines.split(",")
        cache_url = ""
        if not args.skip_build:
            figures["build"] = {}
            for threads in args.threads.split(","):
                summary, url = build_benchmark(
                    corpus, tokenizer, scratch / "caches", kinds, args.rounds, threads
                )
                print_build_table(threads, summary)
                figures["build"][f"rayon_{threads}"] = summary
                cache_url = cache_url or url
        if not args.skip_loader:
            if not cache_url:
                print("\nbuilding one cache for the loader (Ray, 2 workers)", flush=True)
                built = spawn_build("ray2", corpus, tokenizer, scratch / "loader", "auto")
                cache_url = built["cache_url"]
            print("\nloader vs quickstart step", flush=True)
            figures["loader"] = loader_benchmark(
                cache_url, args.batches, args.lazy_batches, args.steps
            )
        figures["seconds"] = round(time.perf_counter() - began)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
