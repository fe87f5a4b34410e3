"""Llama-3-70B at 8k on v5p:4x4x8 (stage 4 x data 32) under GPipe, 1F1B and zero-bubble, compile only
(libtpu, no chips; issue 67): memory per chip, the estimated step and each schedule's bubble.

  python bench/pipeline_plan.py [--compile NAME ...] [--out FILE]

Variants (``config/llama_70b.yaml`` with these keys): ``gpipe_m8`` (as shipped: 256 rows, 8
microbatches), ``gpipe_m16``, ``1f1b_m16`` and ``zero_bubble_m16`` (512 rows, 16
microbatches: rows a microbatch as at m 8). Each variant's ``loomax compile`` report is read from ``--reports`` (a JSON per
variant, ``compile-<variant>.json``, written by ``loomax compile --out``; a full-size compile
takes 10-15 minutes of a loaded 2-core host) or compiled here with ``--compile NAME``. Where a
report has no ``pipeline`` figures (written before ``plan/stage_loop.py``), the step is
traced (not compiled) and they are read off the traced program. Every figure is an estimate
or XLA's memory analysis of the compiled program; none is a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from loomax.config import parse_config  # noqa: E402
from loomax.lm.config import TrainLmConfig  # noqa: E402
from loomax.plan.build import built_step  # noqa: E402
from loomax.plan.compile import CompileResult, compile_run  # noqa: E402
from loomax.plan.stage_loop import pipeline_bubble  # noqa: E402
from loomax.plan.topology import get_topology  # noqa: E402
from loomax.plan.worker import setup_compile_only  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "config" / "llama_70b.yaml"
TOPOLOGY = "v5p:4x4x8"
VARIANTS = {
    "gpipe_m8": [],
    "gpipe_m16": ["--trainer.train_batch_size", "512", "--trainer.pipeline.microbatches", "16"],
    "1f1b_m16": [
        "--trainer.train_batch_size", "512", "--trainer.pipeline.microbatches", "16",
        "--trainer.pipeline.schedule", "1f1b",
    ],
    "zero_bubble_m16": [
        "--trainer.train_batch_size", "512", "--trainer.pipeline.microbatches", "16",
        "--trainer.pipeline.schedule", "zero_bubble",
    ],
}  # fmt: skip


def config_of(name: str) -> TrainLmConfig:
    return parse_config(TrainLmConfig, str(CONFIG), VARIANTS[name])


def with_pipeline(result: CompileResult, config: TrainLmConfig, topology) -> CompileResult:
    """``result`` with its staged loop's figures, from a trace of the step if it has none."""
    if result.pipeline is None:
        with built_step(config, topology.devices) as built:
            jaxpr = built.trace().jaxpr
        stages = dict(built.trainer.mesh.shape)["stage"]
        found = pipeline_bubble(jaxpr, config.trainer.pipeline, stages)
        result = dataclasses.replace(result, pipeline=found.to_json())
    return result


def row(name: str, config: TrainLmConfig, r: CompileResult) -> dict:
    p = r.pipeline or {}
    gb = 1e9
    return {
        "variant": name,
        "schedule": p.get("schedule"),
        "stages": p.get("stages"),
        "microbatches": p.get("microbatches"),
        "rows_per_step": config.trainer.batch_schedule.sizes[0],
        "fits": r.fits,
        "total_gb": r.total_bytes / gb,
        "temp_gb": r.temp_bytes / gb,
        "state_gb": r.state_bytes / gb,
        "hbm_gb": (r.hbm_bytes or 0) / gb,
        "over_gb": r.over_bytes / gb,
        "est_step_s": r.est_step_s,
        "est_best_s": r.est_best_s,
        "est_mfu": r.est_mfu,
        "step_over_model_flops": r.step_flops / r.model_flops if r.model_flops else None,
        "comm_tb": r.comm_bytes / 1e12,
        "bubble": {k: p.get(k) for k in ("formula", "slots_bubble", "counted", "lockstep")},
        "loop_slots": p.get("slots"),
        "busy_slots": p.get("busy"),
        "compile_s": r.compile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", default=".", help="folder of compile-<variant>.json")
    parser.add_argument("--compile", nargs="*", default=[], choices=list(VARIANTS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_compile_only(TOPOLOGY)
    topology = get_topology(TOPOLOGY)
    rows, reports = [], {}
    for name in VARIANTS:
        config = config_of(name)
        path = Path(args.reports) / f"compile-{name}.json"
        if name in args.compile:
            result = compile_run(config, topology)
        elif path.exists():
            result = CompileResult(**json.loads(path.read_text()))
        else:
            print(f"{name}: no report at {path} (compile it with --compile {name})")
            continue
        result = with_pipeline(result, config, topology)
        reports[name] = result.to_json()
        rows.append(row(name, config, result))
    print(
        f"{'variant':<10} {'rows':>5} {'GB/chip':>8} {'of':>5} {'fits':>5} {'est. step':>9} "
        f"{'MFU':>6} {'slots':>5} {'formula':>8} {'counted':>8} {'lockstep':>8}"
    )
    for r in rows:
        b = r["bubble"]
        lock = "-" if b["lockstep"] is None else f"{b['lockstep']:.1%}"
        step = f"{r['est_step_s']:.0f} s" if r["est_step_s"] else "-"
        mfu = f"{r['est_mfu']:.1%}" if r["est_mfu"] else "-"
        print(
            f"{r['variant']:<10} {r['rows_per_step']:>5} {r['total_gb']:>8.1f} {r['hbm_gb']:>5.0f} "
            f"{str(r['fits']):>5} {step:>9} {mfu:>6} {r['loop_slots']:>5} "
            f"{b['formula']:>8.1%} {b['counted']:>8.1%} {lock:>8}"
        )
    out = {
        "what": "config/llama_70b.yaml on v5p:4x4x8 (stage 4 x data 32), compile only "
        "(libtpu, no chips): XLA's memory analysis, the plan's estimates and the bubble as "
        "estimates (plan/stage_loop.py); no figure is a measurement",
        "host": "AMD EPYC, 2 cores, loaded (compile times only)",
        "rows": rows,
        "reports": reports,
    }
    text = json.dumps(out, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
