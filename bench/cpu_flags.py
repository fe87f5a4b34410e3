"""XLA CPU flag sets side by side: `loomax bench` under each, alternating, one table.

    .venv/bin/python bench/cpu_flags.py                       # every candidate, 2 rounds
    .venv/bin/python bench/cpu_flags.py --rounds 3 --steps 8 --only none,onednn

Each round runs `loomax bench --config_path CONFIG` once per candidate, in turn, as a fresh
process with `LOOMAX_XLA_DEFAULTS=0` and `XLA_FLAGS` set to the candidate (so the project's
own default is one candidate among the others, not a layer under them), and the order is
reversed every other round so no candidate always runs right after another. The persistent
compilation cache is off, so every compile is timed.

Per candidate it prints the median tokens/s and compile seconds over rounds, the ratio to the
first candidate, which kernel libraries the compiled step calls (`hlo_library_calls`: oneDNN,
XNN, YNN fusions or custom calls, counted in the compiled HLO: a flag that changes nothing
shows the same counts as no flag), and whether the final loss equals the first candidate's
bitwise (same seed, same batches, same number of steps). /proc/loadavg is recorded before
each run: on a shared machine only the ratios of one invocation mean anything. The last
stdout line is JSON with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from alternate import alternate  # bench/ (this script's folder)

REPO = Path(__file__).resolve().parent.parent
LOOMAX = REPO / ".venv" / "bin" / "loomax"

CANDIDATES = {
    "none": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "onednn_custom_call": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true",
    "onednn_fusion_dot": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot",
    "no_ynn": "--xla_cpu_experimental_ynn_fusion_type=",
    "xnn_dot": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "ynn_all": "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce",
    "llvm_o1": "--xla_backend_optimization_level=1",
    "elemental_emitters": "--xla_cpu_use_fusion_emitters=false",
}


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_one(flags: str, args: argparse.Namespace) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    env.update(JAX_PLATFORMS="cpu", LOOMAX_XLA_DEFAULTS="0", XLA_FLAGS=flags)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    cmd = [str(LOOMAX), "bench", "--config_path", args.config, "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), *args.extra]
    load = loadavg()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": proc.stderr[-2000:], "load": load}
    result = json.loads(lines[-1])
    result["load"] = load
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="config/bench/gpt2_tiny.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default=None, help="comma-separated candidate names")
    parser.add_argument(
        "--flags", action="append", default=[], metavar="NAME=FLAGS", help="an extra candidate"
    )
    parser.add_argument("extra", nargs="*", help="more `loomax bench` overrides (after --)")
    args = parser.parse_args()
    candidates = dict(CANDIDATES)
    for item in args.flags:
        name, _, flags = item.partition("=")
        candidates[name] = flags
    if args.only:
        candidates = {name: candidates[name] for name in args.only.split(",")}
    runs = alternate(
        candidates, args.rounds, lambda flags: run_one(flags, args), "tokens_per_second"
    )
    base_name = next(iter(candidates))
    base_ok = [r for r in runs[base_name] if "error" not in r]
    base_tps = statistics.median(r["tokens_per_second"] for r in base_ok) if base_ok else None
    base_loss = base_ok[0]["final_loss"] if base_ok else None
    summary = {}
    print(
        f"\n{'candidate':<20} {'tokens/s':>9} {'vs ' + base_name:>9} {'compile s':>9}  "
        f"{'loss equal':<10} {'HLO':<12} library calls (onednn/xnn/ynn)  XLA_FLAGS"
    )
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            print(f"{name:<20} FAILED: {results[0]['error'][-300:]}")
            summary[name] = {"failed": True}
            continue
        tps = statistics.median(r["tokens_per_second"] for r in ok)
        compile_s = statistics.median(r["compile_s"] for r in ok)
        losses = {r["final_loss"] for r in ok}
        equal = losses == {base_loss}
        calls = ok[0].get("hlo_library_calls", {})
        calls_text = "/".join(str(calls.get(k, "?")) for k in ("onednn", "xnn", "ynn"))
        ratio = tps / base_tps if base_tps else float("nan")
        print(
            f"{name:<20} {tps:9.1f} {ratio:9.3f} {compile_s:9.2f}  {str(equal):<10} "
            f"{ok[0].get('hlo_fingerprint', '?'):<12} {calls_text:<31} {candidates[name] or '(none)'}"
        )
        summary[name] = {
            "flags": candidates[name],
            "tokens_per_second": tps,
            "ratio": round(ratio, 4),
            "compile_s": compile_s,
            "loss_equal": equal,
            "final_losses": sorted(losses),
            "hlo_library_calls": calls,
            "hlo_fingerprint": ok[0].get("hlo_fingerprint"),
            "rounds": [r["tokens_per_second"] for r in ok],
            "loads": [r["load"] for r in results],
        }
    print(json.dumps({"summary": summary, "runs": runs}))
    return 0 if all("failed" not in s for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
