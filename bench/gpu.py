"""The GPU checks and benchmarks of Loomax's default GPU path, in one unattended run.

``bench/gpu.sh`` runs this on a CUDA host (offline: Loomax's extra packages come from a
wheel folder). Each section runs in its own process with its own time limit, in order of
importance, until the budget is spent; a section that fails or times out is recorded and
the run goes on. One table is printed last, and everything goes to ``gpu_results.json``
(in ``$OUT`` when set, else ``bench/results/``) after every section.

Sections:
- ``env``: JAX, CUDA/cuDNN, the GPU.
- ``attention``: cuDNN attention against the xla and blockwise backends and a float32
  reference (values and gradients; causal and document masks; MHA and GQA; bf16), the
  cases where ``auto`` must fall back, and that a jitted model really calls cuDNN.
- ``gpt2-*``, ``llama1b-*``: ``loomax bench`` on GPT-2 124M (seq 1024) and the Llama-1B
  shape (seq 4096), bf16 compute, tokens/s and MFU; variants differ by one setting.
- ``torch-gpt2``: the nanoGPT-style PyTorch GPT-2 under ``torch.compile`` (bench/torch_gpt2.py).
- ``train``: the quickstart for 100 steps in f32 and in bf16 (device memory metrics in
  metrics.jsonl); its data is built in memory, in this process (no Ray on the host).
- ``resume``: a checkpoint written on the GPU resumes bitwise on the GPU (20 steps
  straight against 10 + 10 resumed, deterministic XLA reductions).
- ``moe``: the routed MLP with ``ragged_dot`` and the blocked form against the dense model
  of the same active width: tokens/s, active TFLOP/s, XLA's FLOPs over the active count.

``--smoke`` runs every section at toy sizes (works on CPU: checks this script).

This file is the driver (the plan, one process per section, the table); the sections live in
``gpu_checks.py`` (env, attention), ``gpu_variants.py`` (the ``loomax bench`` variants,
torch), ``gpu_train.py`` (train, resume) and ``gpu_moe.py`` (moe).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_checks import GPT2_BATCH, LLAMA_BATCH, REPO, section_attention, section_env
from gpu_moe import section_moe
from gpu_train import section_resume, section_train
from gpu_variants import GPT2_VARIANTS, LLAMA_VARIANTS, section_bench, section_torch

__all__ = ["REPO", "best_gpt2", "main", "table"]


CHILDREN = {
    "env": section_env,
    "attention": section_attention,
    "torch-gpt2": section_torch,
    "torch-gpt2-b64": lambda args: section_torch(args, batch=64),
    "train": section_train,
    "resume": section_resume,
    "moe": section_moe,
}


def child_function(name: str):
    if name in GPT2_VARIANTS or name in LLAMA_VARIANTS:
        return section_bench
    return CHILDREN[name]


def section_flags(name: str) -> str:
    if name in GPT2_VARIANTS:
        return GPT2_VARIANTS[name][1]
    if name in LLAMA_VARIANTS:
        return LLAMA_VARIANTS[name][1]
    if name == "resume":  # bitwise resume needs reproducible reductions
        return "--xla_gpu_deterministic_ops=true"
    if name == "attention":  # ~40 small programs: autotuning took most of its 150 s on an H200
        return "--xla_gpu_autotune_level=0"
    return ""


# (name, time limit in seconds) in order of importance; the budget cuts the tail
PLAN = [  # the measured best of each model first, then what the next GPU session should try
    ("env", 60),
    ("attention", 150),
    ("gpt2-ntg-unscanned", 120),
    ("torch-gpt2", 200),
    ("llama1b-unscanned", 200),
    ("llama1b-unscanned-packed", 200),
    ("llama1b-unscanned-fp8", 200),
    ("moe", 240),
    ("train", 200),
    ("resume", 150),
    ("gpt2-unscanned", 120),
    ("gpt2-ntg-unscanned-ce16k", 120),
    ("gpt2-ntg-unscanned-cudnn-ln", 120),
    ("gpt2-ntg-unscanned-b64", 120),
    ("torch-gpt2-b64", 200),
    ("llama1b-ntg-unscanned", 200),
    ("gpt2-ntg-unscanned-remat", 120),
    ("gpt2-ntg-remat", 150),
    ("gpt2-ntg-remat-pad128", 120),
    ("gpt2-ntg-save-attn", 120),
    ("gpt2-ntg-save-dots", 120),
    ("llama1b", 240),
    ("llama1b-packed", 200),
    ("gpt2-ntg-b64-pad128", 150),
    ("gpt2", 180),
    ("gpt2-remat", 150),
    ("gpt2-xla-attn", 150),
    ("gpt2-no-triton-gemm", 150),
    ("llama1b-no-docmask", 200),
    ("llama1b-remat", 200),
    ("gpt2-ce-unblocked", 150),
    ("gpt2-ntg-remat-unroll", 150),
    ("gpt2-ntg-unroll", 150),
    ("gpt2-ntg-remat-v50304", 150),
    ("llama1b-ntg", 200),
    ("llama1b-ntg-unroll", 200),
    ("gpt2-ntg-remat-ce16k", 150),
]
MIN_SECTION_S = 40
"""A section is not started with less than this left of the budget."""


# --------------------------------------------------------------------------- driver
def run_child(name: str, args, out_dir: Path, limit: float) -> dict:
    result_file = out_dir / f".{name}.json"
    result_file.unlink(missing_ok=True)
    env = dict(os.environ)
    flags = section_flags(name)
    if flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--result",
        str(result_file),
        "--limit",
        str(limit),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--attention-cases",
        args.attention_cases,
    ]
    if args.smoke:
        cmd.append("--smoke")
    start = time.perf_counter()
    with open(out_dir / "gpu_log.txt", "a") as log:
        log.write(f"\n===== {name} (limit {limit:.0f} s, XLA_FLAGS={env.get('XLA_FLAGS', '')})\n")
        log.flush()
        try:
            done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit)
            status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timeout after {limit:.0f} s"
    seconds = round(time.perf_counter() - start, 1)
    if result_file.exists():
        result = json.loads(result_file.read_text())
        result_file.unlink()
    else:
        result = {}
    if status != "ok" and "error" not in result:
        tail = (out_dir / "gpu_log.txt").read_text().splitlines()[-12:]
        result["error"] = status + ": " + " | ".join(tail)[-1500:]
    result["status"], result["seconds"] = status if "error" not in result else "failed", seconds
    return result


def child_main(args) -> None:
    import faulthandler

    if args.limit:  # a section that hangs leaves every thread's stack in the log
        faulthandler.dump_traceback_later(max(args.limit - 4, 1), exit=False)
    try:
        result = child_function(args.child)(args)
    except BaseException as e:
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"[:2000]}
    Path(args.result).write_text(json.dumps(result, default=str))
    sys.exit(1 if "error" in result else 0)


def best_gpt2(results: dict, b64: bool = False) -> dict:
    """The fastest GPT-2 124M variant of the run at vocab 50257 (the torch side's), with its
    name: at batch 32, or with ``b64`` at batch 64 (the ``-b64`` variants)."""
    runs = [
        dict(r, name=n)
        for n, r in results.items()
        if n in GPT2_VARIANTS
        and "tokens_per_second" in r
        and "v50304" not in n
        and ("-b64" in n) == b64
    ]
    return max(runs, key=lambda r: r["tokens_per_second"], default={})


def fmt(x, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict) -> str:
    lines = []
    env = results.get("env", {})
    lines.append(
        f"GPU: {env.get('device_kind')} ({env.get('device_memory_gb')} GiB), jax {env.get('jax')}, "
        f"cuDNN {env.get('cudnn')}, torch {env.get('torch')}"
    )
    lines.append(f"{'section':22} {'status':10} {'s':>6}  result")
    for name, r in results.items():
        if name in ("env", "meta"):
            continue
        if "tokens_per_second" in r:
            what = (
                f"{r['tokens_per_second']:>10,.0f} tok/s  step {r['step_ms_median']:.1f} ms  "
                f"MFU {fmt(r.get('mfu'), '.1%')}  mem {fmt(r.get('device_peak_gb') or r.get('peak_memory_gb'))} GiB"
            )
        elif name == "attention" and r.get("cases"):
            worst = max(
                max(v.values()) for c in r["cases"] for k, v in c.items() if isinstance(v, dict)
            )
            what = (
                f"ok={r['ok']} {len(r['cases'])} cases, worst rel err {worst:.4f} (tol "
                f"{r['tolerance']}), model auto->cudnn: {r.get('model_auto_calls_cudnn')}, fallbacks: "
                + "; ".join(f"{f['case']}->{f['auto']}" for f in r.get("fallbacks", []))
            )
        elif name == "train" and "f32" in r:
            what = (
                f"ok={r['ok']} eval f32 {fmt(r['f32']['eval_loss'], '.4f')} bf16 "
                f"{fmt(r['bf16']['eval_loss'], '.4f')} max|dloss| {r['max_abs_train_loss_diff']}, "
                f"memory keys {r['memory_keys']}, device peak {r['device_peak_mb']} MB"
            )
        elif name == "moe" and "moe-ragged_dot" in r:
            what = ", ".join(
                f"{k} {r[k]['tokens_per_s']:,} tok/s {r[k]['active_tflops_per_s']} TFLOP/s "
                f"(XLA/active {r[k]['xla_flops_estimate_over_active']})"
                for k in ("moe-ragged_dot", "moe-blocked", "dense-same-active")
            )
        elif name == "resume" and "ok" in r:
            what = (
                f"ok={r['ok']} losses bitwise {r['losses_bitwise_equal']} over "
                f"{r['loss_steps_compared']} steps, final state bitwise {r['final_state_bitwise_equal']}"
            )
        else:
            what = r.get("error", "")[:200]
        lines.append(f"{name:22} {r.get('status', '-'):10} {fmt(r.get('seconds')):>6}  {what}")
    for torch_name, b64 in (("torch-gpt2", False), ("torch-gpt2-b64", True)):
        torch_r, jax_r = results.get(torch_name, {}), best_gpt2(results, b64)
        if "tokens_per_second" in torch_r and "tokens_per_second" in jax_r:
            lines.append(
                f"loomax GPT-2 ({jax_r['name']}) / torch.compile ({torch_name}): "
                f"{jax_r['tokens_per_second'] / torch_r['tokens_per_second']:.3f}x"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description="Loomax GPU checks and benchmarks")
    p.add_argument("--budget", type=float, default=450, help="seconds for all sections together")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    p.add_argument("--only", default=None, help="comma-separated sections (default: all, in order)")
    p.add_argument("--smoke", action="store_true", help="toy sizes: check the script (CPU too)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per benchmark")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--attention-cases",
        choices=("all", "documents"),
        default="all",
        help="the attention section's cases: all, or only those with document masks",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--limit", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = PLAN
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in dict(PLAN)]
        if unknown:
            p.error(f"--only: unknown section(s) {unknown}; sections: {[n for n, _ in PLAN]}")
        limits = dict(PLAN)
        plan = [("env", limits["env"])] + [(n, limits[n]) for n in wanted if n != "env"]
    deadline = time.perf_counter() + args.budget
    results: dict = {
        "meta": {
            "budget_s": args.budget,
            "smoke": args.smoke,
            "steps": args.steps,
            "gpt2_batch": GPT2_BATCH,
            "llama_batch": LLAMA_BATCH,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    }
    path = out_dir / "gpu_results.json"
    for name, limit in plan:
        left = deadline - time.perf_counter()
        if left < MIN_SECTION_S:
            results[name] = {"status": "skipped", "error": f"budget spent ({left:.0f} s left)"}
            continue
        print(f"--- {name} (up to {min(limit, left):.0f} s)", flush=True)
        results[name] = run_child(name, args, out_dir, min(limit, left))
        path.write_text(json.dumps(results, indent=1, default=str))
        print(f"    {results[name]['status']} in {results[name]['seconds']} s", flush=True)
    for torch_name, b64 in (("torch-gpt2", False), ("torch-gpt2-b64", True)):
        torch_r, jax_r = results.get(torch_name, {}), best_gpt2(results, b64)
        if "tokens_per_second" in torch_r and jax_r.get("peak_gflops"):  # the same FLOPs count
            torch_r["mfu"] = round(
                torch_r["tokens_per_second"]
                * jax_r["flops_per_token"]
                / (jax_r["peak_gflops"] * 1e9),
                4,
            )
    path.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
