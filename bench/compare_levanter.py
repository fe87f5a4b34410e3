"""Side-by-side training throughput: Loomax's train step vs Levanter's Trainer, same tiny GPT-2.

Standard library only; run with any Python 3.11 from the repository root or elsewhere:

    python3 bench/compare_levanter.py                    # 2 rounds each, 10 timed steps per run
    python3 bench/compare_levanter.py --rounds 3 --steps 20
    python3 bench/compare_levanter.py --only levanter    # one side only

What it does:
  1. creates <repo>/.venv-levanter (python3 -m venv + pip install of Levanter and its pins) if it
     is missing or cannot import levanter; --no-setup skips this;
  2. runs, as subprocesses and interleaved (levanter, loomax, levanter, loomax, ...) so both sides
     share the same machine noise:
        <repo>/.venv-levanter/bin/python bench/levanter_gpt2_tiny.py --steps N
        <repo>/.venv/bin/loomax bench --config_path config/bench/gpt2_tiny.yaml --steps N
     every one with the same environment (JAX_PLATFORMS=cpu; XLA_FLAGS removed unless --xla-flags
     is given; PYTHONPATH removed so neither virtualenv sees the other's packages);
  3. parses the last JSON line of each run's stdout, and prints per implementation the median over
     rounds of tokens/s, step ms and compile s, the ratio loomax/levanter of tokens/s, and finally
     one JSON line with both results and the ratio.

A side that fails (missing executable, non-zero exit, no JSON line, timeout) is reported with the tail
of its stderr, marked failed, and the script exits with status 1 after printing what it has.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEVANTER_VENV = REPO / ".venv-levanter"
LEVANTER_PY = LEVANTER_VENV / "bin" / "python"
LEVANTER_SCRIPT = REPO / "bench" / "levanter_gpt2_tiny.py"
LOOMAX_BIN = REPO / ".venv" / "bin" / "loomax"
DEFAULT_LOOMAX_CONFIG = "config/bench/gpt2_tiny.yaml"

# The combination known to resolve and install. chex is imported by levanter.optim but is not
# pulled in by this levanter/optax combination, so it is installed explicitly.
LEVANTER_PIP_REQUIREMENTS = [
    "--pre",
    "levanter",
    "jax==0.7.2",
    "jaxlib==0.7.2",
    "gitpython",
    "chex",
]

REQUIRED_KEYS = ("compile_s", "step_ms_median", "tokens_per_second")
SUMMARY_KEYS = ("tokens_per_second", "step_ms_median", "compile_s", "flops_per_token", "mfu")
IMPLS = ("levanter", "loomax")


def log(msg: str = "") -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# Levanter virtualenv
# --------------------------------------------------------------------------------------------


def levanter_venv_ok() -> bool:
    if not LEVANTER_PY.exists():
        return False
    probe = subprocess.run(
        [str(LEVANTER_PY), "-c", "import levanter, haliax, jax"],
        capture_output=True,
        text=True,
        env=child_env(None),
    )
    return probe.returncode == 0


def ensure_levanter_venv() -> bool:
    if levanter_venv_ok():
        return True
    log(f"== setting up {LEVANTER_VENV} (a few minutes)")
    if not LEVANTER_PY.exists():
        rc = subprocess.run([sys.executable, "-m", "venv", str(LEVANTER_VENV)]).returncode
        if rc != 0:
            log(f"!! python -m venv failed with status {rc}")
            return False
    cmd = [str(LEVANTER_PY), "-m", "pip", "install", *LEVANTER_PIP_REQUIREMENTS]
    log("$ " + shlex.join(cmd))
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        log(f"!! pip install failed with status {rc}")
        return False
    if not levanter_venv_ok():
        log("!! levanter still cannot be imported after installation")
        return False
    return True


# --------------------------------------------------------------------------------------------
# Running one benchmark
# --------------------------------------------------------------------------------------------


def child_env(xla_flags: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("XLA_FLAGS", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(var, None)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def command_for(impl: str, args: argparse.Namespace) -> list[str]:
    if impl == "levanter":
        return [str(LEVANTER_PY), str(LEVANTER_SCRIPT), "--steps", str(args.steps)]
    return [
        str(LOOMAX_BIN),
        "bench",
        "--config_path",
        args.loomax_config,
        "--steps",
        str(args.steps),
    ]


def last_json_object(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def tail(text: str, n: int) -> str:
    return "\n".join(text.splitlines()[-n:])


def run_one(impl: str, round_idx: int, args: argparse.Namespace) -> dict:
    """Runs one benchmark subprocess; returns a record with 'ok', 'result' or 'error'."""
    tag = f"[{impl} r{round_idx + 1}]"
    cmd = command_for(impl, args)
    record: dict = {"impl": impl, "round": round_idx + 1, "cmd": shlex.join(cmd), "ok": False}
    log(f"== {tag} $ {shlex.join(cmd)}")

    if not Path(cmd[0]).exists():
        record["error"] = f"executable not found: {cmd[0]}"
        log(f"!! {tag} {record['error']}")
        return record

    stdout_lines: list[str] = []
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as err_file:
        t0 = time.perf_counter()
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=child_env(args.xla_flags),
                stdout=subprocess.PIPE,
                stderr=err_file,
                text=True,
                errors="replace",
                bufsize=1,
            )
        except OSError as e:
            record["error"] = f"could not start: {e}"
            log(f"!! {tag} {record['error']}")
            return record

        timed_out = threading.Event()

        def on_timeout() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(args.timeout, on_timeout)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                stdout_lines.append(line.rstrip("\n"))
                if not args.quiet:
                    log(f"{tag} {line.rstrip()}")
            rc = proc.wait()
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        err_file.seek(0)
        stderr = err_file.read()

    record["wall_s"] = round(wall, 2)
    record["returncode"] = rc
    result = last_json_object("\n".join(stdout_lines))

    problem = None
    if timed_out.is_set():
        problem = f"timed out after {args.timeout}s"
    elif rc != 0:
        problem = f"exited with status {rc}"
    elif result is None:
        problem = "no JSON line in stdout"
    else:
        missing = [k for k in REQUIRED_KEYS if not isinstance(result.get(k), int | float)]
        if missing:
            problem = f"JSON line lacks numeric {', '.join(missing)}"

    if problem is not None:
        record["error"] = problem
        log(f"!! {tag} FAILED: {problem}")
        if stderr.strip():
            log(f"--- {tag} stderr (last {args.stderr_lines} lines) ---")
            log(tail(stderr, args.stderr_lines))
        if args.quiet and stdout_lines:
            log(f"--- {tag} stdout (last 10 lines) ---")
            log(tail("\n".join(stdout_lines), 10))
        return record

    record["ok"] = True
    record["result"] = result
    log(
        f"== {tag} ok in {wall:.0f}s: {result['tokens_per_second']:.1f} tokens/s, "
        f"{result['step_ms_median']:.1f} ms/step, compile {result['compile_s']:.1f}s"
    )
    return record


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def summarize(records: list[dict]) -> dict:
    ok = [r["result"] for r in records if r["ok"]]
    summary: dict = {
        "rounds_ok": len(ok),
        "rounds_failed": sum(1 for r in records if not r["ok"]),
    }
    for key in SUMMARY_KEYS:
        vals = [float(r[key]) for r in ok if isinstance(r.get(key), int | float)]
        summary[key] = round(statistics.median(vals), 6) if vals else None
    summary["tokens_per_second_all"] = [r["tokens_per_second"] for r in ok]
    errors = [r["error"] for r in records if not r["ok"]]
    if errors:
        summary["errors"] = errors
    return summary


def fmt(value, spec: str) -> str:
    width = int(spec.split(".")[0])
    return f"{'-':>{width}}" if value is None else format(value, spec)


def print_table(summaries: dict[str, dict], ratio: float | None) -> None:
    header = f"{'impl':<10} {'ok/runs':>8} {'tokens/s':>10} {'step ms':>10} {'compile s':>10} {'MFLOP/tok':>10} {'mfu':>7}"
    log()
    log(header)
    log("-" * len(header))
    for impl, s in summaries.items():
        runs = f"{s['rounds_ok']}/{s['rounds_ok'] + s['rounds_failed']}"
        fpt = s["flops_per_token"] / 1e6 if s["flops_per_token"] is not None else None
        log(
            f"{impl:<10} {runs:>8} {fmt(s['tokens_per_second'], '10.1f')} "
            f"{fmt(s['step_ms_median'], '10.1f')} {fmt(s['compile_s'], '10.2f')} {fmt(fpt, '10.1f')} "
            f"{fmt(s['mfu'], '7.4f')}"
        )
    log("(medians over rounds; compile s = wall time of the first step, including one execution)")
    log(
        "(MFLOP/tok: each side's own count: Loomax's counts causal attention as half the score "
        "matrix, Levanter's the full square plus the mask; compare tokens/s, not mfu)"
    )
    if ratio is not None:
        log(f"loomax / levanter tokens/s: {ratio:.3f}")
    log()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="runs per implementation (default 2)")
    p.add_argument("--only", choices=IMPLS, help="run only one side")
    p.add_argument(
        "--loomax-config", default=DEFAULT_LOOMAX_CONFIG, help="config for `loomax bench`"
    )
    p.add_argument("--xla-flags", default=None, help="XLA_FLAGS for both sides (default: unset)")
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per run before it is killed"
    )
    p.add_argument("--no-setup", action="store_true", help="do not create/repair .venv-levanter")
    p.add_argument("--quiet", action="store_true", help="do not echo the benchmarks' stdout")
    p.add_argument(
        "--stderr-lines", type=int, default=40, help="stderr lines shown for a failed run"
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    impls = [args.only] if args.only else list(IMPLS)

    setup_failed = False
    if "levanter" in impls and not args.no_setup:
        setup_failed = not ensure_levanter_venv()

    records: dict[str, list[dict]] = {impl: [] for impl in impls}
    for round_idx in range(args.rounds):
        for impl in impls:
            if impl == "levanter" and setup_failed:
                records[impl].append(
                    {
                        "impl": impl,
                        "round": round_idx + 1,
                        "ok": False,
                        "error": "levanter venv setup failed",
                    }
                )
                continue
            records[impl].append(run_one(impl, round_idx, args))

    summaries = {impl: summarize(records[impl]) for impl in impls}
    ratio = None
    if len(impls) == 2:
        lt = summaries["levanter"]["tokens_per_second"]
        mt = summaries["loomax"]["tokens_per_second"]
        if lt and mt:
            ratio = mt / lt

    print_table(summaries, ratio)
    any_failed = any(s["rounds_failed"] > 0 for s in summaries.values())
    final = {
        "steps": args.steps,
        "rounds": args.rounds,
        "xla_flags": args.xla_flags,
        **summaries,
        "ratio_loomax_over_levanter_tokens_per_second": ratio,
        "ok": not any_failed,
    }
    print(json.dumps(final), flush=True)
    return 1 if any_failed else 0


if __name__ == "__main__":
    sys.exit(main())
