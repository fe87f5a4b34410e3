"""Loomax's CPU train step against the nanoGPT-style PyTorch peer, alternating in one run.

    .venv/bin/python bench/torch_compare.py                       # 2 rounds, 10 timed steps each
    .venv/bin/python bench/torch_compare.py --rounds 3 \\
        --variant no_remat="--model.gradient_checkpointing false"

Each round runs, as fresh processes and in turn (the order reversed every other round):
the peer (`../shared/peers/torch_gpt2_bench.py --compile --steps N --warmup 3`, the script
the acceptance measurement runs, under `--torch-python`), and `loomax bench --config_path
config/bench/gpt2_tiny.yaml --steps N` once per variant (the plain config, then each
`--variant NAME="OVERRIDES"`). Same model on both sides: GPT-2 hidden 256, 4 layers, 4
heads, seq 256, vocab 50257 tied, batch 8, f32, AdamW. Loomax runs with its default XLA
flags (`XLA_FLAGS` unset) and no persistent compilation cache.

Prints per side the median tokens/s over rounds, its ratio to torch.compile (the ratio of
medians, as the acceptance measurement takes it) and the ratio per round; /proc/loadavg is
recorded before each run, since on a shared machine only the ratios of one run mean
anything. The last stdout line is JSON with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from alternate import alternate  # bench/ (this script's folder)

REPO = Path(__file__).resolve().parent.parent
PEER = REPO.parent / "shared" / "peers" / "torch_gpt2_bench.py"
LOOMAX = REPO / ".venv" / "bin" / "loomax"
CONFIG = "config/bench/gpt2_tiny.yaml"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def last_json(stdout: str) -> dict | None:
    """The last JSON object in ``stdout`` (the peer prints it indented over several lines)."""
    start = stdout.rfind("\n{")
    text = stdout[start + 1 :] if start >= 0 else stdout
    try:
        return json.loads(text)
    except ValueError:
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None


def run(cmd: list[str], env: dict[str, str]) -> dict:
    load = loadavg()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    result = last_json(proc.stdout) if proc.returncode == 0 else None
    if result is None:
        return {"error": (proc.stderr or proc.stdout)[-2000:], "load": load}
    result["load"] = load
    result["tps"] = result.get("tokens_per_second", result.get("tokens_per_s"))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--torch-python", default=str(REPO / ".venv" / "bin" / "python"))
    parser.add_argument("--peer", default=str(PEER))
    parser.add_argument("--no-compile", action="store_true", help="time the peer in eager mode")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='NAME="OVERRIDES"',
        help="a Loomax variant",
    )
    parser.add_argument("--no-default", action="store_true", help="skip the plain Loomax config")
    args = parser.parse_args()

    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    peer_name = "torch.eager" if args.no_compile else "torch.compile"
    peer = [args.torch_python, args.peer, "--steps", str(args.steps), "--warmup", "3"]
    if not args.no_compile:
        peer.append("--compile")
    sides = {peer_name: peer}
    loomax = [str(LOOMAX), "bench", "--config_path", CONFIG, "--steps", str(args.steps)]
    if not args.no_default:
        sides["loomax"] = loomax
    for item in args.variant:
        name, _, overrides = item.partition("=")
        sides[f"loomax:{name}"] = loomax + shlex.split(overrides)

    runs = alternate(sides, args.rounds, lambda command: run(command, env), "tps")

    def tps(name: str) -> list[float]:
        return [r["tps"] for r in runs[name] if "error" not in r]

    peer_tps = tps(peer_name)
    peer_median = statistics.median(peer_tps) if peer_tps else None
    summary = {}
    print(f"\n{'side':<24} {'tokens/s':>9} {'vs ' + peer_name:>17}  per round")
    for name in sides:
        values = tps(name)
        if not values:
            print(f"{name:<24} FAILED: {runs[name][0]['error'][-400:]}")
            summary[name] = {"failed": True}
            continue
        median = statistics.median(values)
        ratio = median / peer_median if peer_median else float("nan")
        per_round = [
            round(a["tps"] / b["tps"], 3)
            for a, b in zip(runs[name], runs[peer_name], strict=True)
            if "error" not in a and "error" not in b
        ]
        print(f"{name:<24} {median:9.1f} {ratio:17.3f}  {per_round}")
        summary[name] = {
            "tokens_per_second": median,
            "ratio": round(ratio, 4),
            "per_round": per_round,
            "loads": [r["load"] for r in runs[name]],
        }
    print(json.dumps({"summary": summary, "runs": runs}))
    return 0 if all("failed" not in s for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
