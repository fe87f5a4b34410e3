"""Token-cache build throughput against `datasets.map`, side by side (issue 51, item 4).

On one corpus (`bench/data.py`'s: the stdlib sources repeated and shuffled into JSONL
shards) with one tokenizer, each build in a fresh process, in rounds whose order rotates:

- `ray<N>`: `build_token_cache` on a fresh local Ray cluster of N CPUs (cluster start timed
  apart, as `build_s` excludes it), with its default `data.fast_encoder: auto` (tiktoken,
  exact for this tokenizer); `ray2_hf` the same with it off (`encode_batch_fast`);
- `map<N>`: `load_dataset("json")` then `.map(batched=True, num_proc=N)` encoding with
  `tokenizers`' `encode_batch_fast` (what a researcher would write) and appending EOS into
  int32 lists; `map<N>_fast` the same encoding with Loomax's fast encoder, to show how
  much of the gain is the encoder and how much the rest of the build.

Every build runs with `RAYON_NUM_THREADS=1` (`--threads`), so each process tokenizes on
one core and N (workers or `num_proc`) is the parallelism on both sides. Every build must
give the same tokens (digest of the token stream and document lengths). Tokens/s is
tokens / `build_s`; medians over `--rounds`.

    python bench/build_vs_map.py [--mb 40] [--shards 16] [--rounds 2] [--threads 1] [--gzip]
                                 [--only ray1,ray2,map2_fast]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from machine import cpu_name  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"
LOAD_BEFORE: list[str] = []
"""/proc/loadavg's 1, 5 and 15 minute load averages when the bench started."""
KINDS = ("ray1", "ray2", "ray2_hf", "map1", "map2", "map1_fast", "map2_fast")


def _bench_data() -> Any:
    spec = importlib.util.spec_from_file_location("bench_data", REPO / "bench" / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(kind: str, corpus: Path, tokenizer: Path, out: Path) -> dict:
    name, _, variant = kind.partition("_")
    if name.startswith("map"):
        num_proc = int(name.removeprefix("map"))
        return _bench_data().build_hf(
            corpus, tokenizer, out, fast=True, num_proc=num_proc, tiktoken=variant == "fast"
        )
    workers = int(name.removeprefix("ray"))
    return _bench_data().build_ray(corpus, tokenizer, out, workers, fast_encoder=variant != "hf")


def spawn(kind: str, corpus: Path, tokenizer: Path, out: Path, threads: str) -> dict:
    """Runs `kind` in a fresh process; its figures and the CPUs busy just before it."""
    data = _bench_data()
    command = [str(PYTHON), __file__, "--child", kind, "--corpus", str(corpus)]
    command += ["--tokenizer", str(tokenizer), "--out", str(out)]
    for attempt in range(3):  # a loaded VM may keep Ray's raylet past its fixed 30 s
        busy = data.busy_cpus()
        proc = subprocess.run(command, env=data.thread_env(threads), capture_output=True, text=True)
        if proc.returncode == 0:
            break
        print(f"{kind} failed (attempt {attempt}): {proc.stderr[-300:]}", file=sys.stderr)
    else:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"busy_before": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=40.0, help="corpus size in MB of JSONL")
    parser.add_argument("--shards", type=int, default=16, help="JSONL files")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", default="1", help="RAYON_NUM_THREADS of every build")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--gzip", action="store_true", help="gzip every shard (.jsonl.gz)")
    parser.add_argument("--only", default=",".join(KINDS), help="the builds to run, by kind")
    parser.add_argument(
        "--cpu", default="", help="the CPU as the README names it (kept in the JSON)"
    )
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(args.child, Path(args.corpus), Path(args.tokenizer), Path(args.out))
        print(json.dumps({k: v for k, v in result.items() if k != "cache_url"}))
        return
    global LOAD_BEFORE
    LOAD_BEFORE = Path("/proc/loadavg").read_text().split()[:3]  # before the corpus is made
    print(f"load average before: {' '.join(LOAD_BEFORE)}", file=sys.stderr, flush=True)
    data = _bench_data()
    work = Path(tempfile.mkdtemp(prefix="loomax-build-vs-map-"))
    plain = data.make_corpus(work / "corpus", args.mb, args.shards)
    if args.gzip:  # both sides read the .gz files (datasets' json loader decompresses them)
        for path in plain:
            with path.open("rb") as src, gzip.open(f"{path}.gz", "wb", 6) as out:
                data.shutil.copyfileobj(src, out)
            path.unlink()
    tokenizer = data.train_tokenizer(work / "tokenizer.json", args.vocab)
    kinds = tuple(k for k in KINDS if k in args.only.split(","))
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        order = kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]
        for kind in order:
            out = work / f"{kind}-{round_}"
            result = spawn(kind, work / "corpus", tokenizer, out, args.threads)
            result["tokens_per_s"] = result["tokens"] / result["build_s"]
            runs[kind].append(result)
            print(
                f"round {round_} {kind}: {result['build_s']:.2f} s, "
                f"{result['tokens_per_s'] / 1e6:.3f} M tok/s, busy before "
                f"{result['busy_before']}",
                file=sys.stderr,
                flush=True,
            )
    digests = {r["digest"] for rs in runs.values() for r in rs}
    median = {k: statistics.median(r["tokens_per_s"] for r in rs) for k, rs in runs.items()}

    def ratio(a: str, b: str) -> float | None:
        return median[a] / median[b] if a in median and b in median else None

    summary = {
        "cpu": f"{cpu_name()}, {data.os.cpu_count()} CPUs",
        "cpu_named": args.cpu,
        "corpus": {
            "mb": args.mb,
            "shards": args.shards,
            "gzip": args.gzip,
            "tokens": next(iter(runs.values()))[0]["tokens"],
        },
        "rayon_threads": args.threads,
        "rounds": args.rounds,
        "same_tokens": len(digests) == 1,
        "median_tokens_per_s": median,
        "median_build_s": {
            k: statistics.median(r["build_s"] for r in rs) for k, rs in runs.items()
        },
        "ray_startup_s": {
            k: [r["startup_s"] for r in runs[k]] for k in kinds if "startup_s" in runs[k][0]
        },
        "ray2_over_map2": ratio("ray2", "map2"),
        "ray1_over_map1": ratio("ray1", "map1"),
        "ray2_over_map2_fast": ratio("ray2", "map2_fast"),
        "ray1_over_map1_fast": ratio("ray1", "map1_fast"),
        "ray2_hf_over_map2": ratio("ray2_hf", "map2"),
        "load_average_before": LOAD_BEFORE,
        "runs": runs,
    }
    for kind in kinds:
        print(f"{kind}: {median[kind] / 1e6:.3f} M tok/s (median of {args.rounds})")
    pairs = [k for k in summary if k.endswith(("_over_map1", "_over_map2", "_fast")) and summary[k]]
    print(
        "; ".join(f"{k.replace('_over_', ' / ')} = {summary[k]:.2f}x" for k in pairs)
        + f"; same tokens: {summary['same_tokens']}"
    )
    print(json.dumps(summary))
    data.shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
