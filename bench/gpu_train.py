"""bench/gpu.py's ``train`` (the quickstart in f32 and bf16) and ``resume`` sections."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from gpu_checks import REPO


def _metrics(run_dir: Path) -> list[dict]:
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def _series(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r and "step" in r}


def _quickstart_runner(args):
    """``train(run, *overrides)``: the quickstart (data in memory, no Ray) into ``work/run``."""
    from loomax.config import parse_config
    from loomax.lm import TrainLmConfig
    from loomax.train_lm import train_lm

    work = Path(tempfile.mkdtemp(prefix="loomax-gpu-train-"))
    overlay = work / "memory.yaml"
    overlay.write_text("trainer:\n  hooks:\n    - type: memory\n      every: 10\n")
    base = [
        "--data.cache_dir",
        "memory://quickstart",
        "--trainer.progress_bar",
        "false",
        "--trainer.checkpointer.save_interval",
        "null",
    ]
    if args.smoke:
        base += ["--data.train", '[{"embedded": "python_stdlib", "max_documents": 100}]']

    def train(run: str, *extra: str):
        config = parse_config(
            TrainLmConfig,
            REPO / "config/quickstart.yaml",
            [*base, "--overlay", str(overlay), "--trainer.run_dir", str(work / run), *extra],
        )
        start = time.perf_counter()
        result = train_lm(config)
        return result, time.perf_counter() - start

    return train, work


def section_train(args) -> dict:
    import jax

    train, work = _quickstart_runner(args)
    steps = 20 if args.smoke else 100
    out: dict = {"steps": steps}
    runs = {}
    for label, mp in (("f32", "f32"), ("bf16", "p=f32,c=bfloat16")):
        result, seconds = train(
            label,
            "--trainer.mp",
            mp,
            "--trainer.num_train_steps",
            str(steps),
            "--trainer.steps_per_eval",
            str(steps),
        )
        records = _metrics(work / label)
        runs[label] = records
        out[label] = {
            "seconds": round(seconds, 1),
            "eval_loss": result.evals[-1][1]["eval/loss"] if result.evals else None,
            "train_loss": _series(records, "train/loss"),
            "tokens_per_second": list(_series(records, "throughput/tokens_per_second").values())[
                -1:
            ],
        }
    f32, bf16 = out["f32"]["train_loss"], out["bf16"]["train_loss"]
    common = sorted(set(f32) & set(bf16))
    out["max_abs_train_loss_diff"] = round(max(abs(f32[s] - bf16[s]) for s in common), 4)
    out["eval_loss_rel_diff"] = round(
        abs(out["bf16"]["eval_loss"] / out["f32"]["eval_loss"] - 1), 4
    )
    memory_keys = sorted({k for r in runs["bf16"] for k in r if k.startswith("memory/")})
    out["memory_keys"] = memory_keys
    peak = [r["memory/device_peak_bytes"] for r in runs["bf16"] if "memory/device_peak_bytes" in r]
    out["device_peak_mb"] = round(peak[-1] / 2**20, 1) if peak else None
    on_gpu = jax.default_backend() == "gpu"
    out["tracks"] = out["max_abs_train_loss_diff"] < 0.1 and out["eval_loss_rel_diff"] < 0.02
    out["memory_ok"] = (not on_gpu) or {
        "memory/device_bytes_in_use",
        "memory/device_peak_bytes",
    } <= set(memory_keys)

    out["ok"] = bool(out["tracks"] and out["memory_ok"])
    for label in ("f32", "bf16"):  # keep the JSON short: every 10th loss
        out[label]["train_loss"] = {s: round(v, 4) for s, v in out[label]["train_loss"].items()}
    return out


def section_resume(args) -> dict:
    """A checkpoint written here resumes bitwise: 2k steps straight vs k, stop, resume to 2k."""
    import jax
    import numpy as np

    train, work = _quickstart_runner(args)
    half = 10 if args.smoke else 20
    # a constant learning rate: the schedule must not depend on num_train_steps, which is how
    # the first attempt is made to stop half way
    common_args = [
        "--trainer.mp",
        "p=f32,c=bfloat16",
        "--trainer.log_every",
        "1",
        "--optimizer.lr_schedule",
        "constant",
        "--optimizer.warmup",
        "0",
        "--trainer.steps_per_eval",
        "1000",
        "--trainer.eval_at_start",
        "false",
        "--sample.enabled",
        "false",
    ]
    straight, _ = train("straight", *common_args, "--trainer.num_train_steps", str(2 * half))
    train("resumed", *common_args, "--trainer.num_train_steps", str(half))
    resumed, _ = train("resumed", *common_args, "--trainer.num_train_steps", str(2 * half))
    a = _series(_metrics(work / "straight"), "train/loss")
    b = _series(_metrics(work / "resumed"), "train/loss")
    after = [s for s in sorted(a) if s > half]
    leaves_a = jax.tree.leaves(straight.final.state)
    leaves_b = jax.tree.leaves(resumed.final.state)
    same_state = len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(leaves_a, leaves_b, strict=True)
        if hasattr(x, "shape")
    )
    out = {
        "steps": f"{2 * half} straight vs {half} + resume to {2 * half}",
        "loss_steps_compared": len(after),
        "losses_bitwise_equal": all(a[s] == b.get(s) for s in after) and bool(after),
        "final_state_bitwise_equal": bool(same_state),
        "first_difference": next(
            ({"step": s, "straight": a[s], "resumed": b.get(s)} for s in after if a[s] != b.get(s)),
            None,
        ),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    out["ok"] = bool(out["losses_bitwise_equal"] and same_state)
    return out
