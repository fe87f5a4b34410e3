"""Ladder results: checkpoints and metrics per size as DataFrames, and loss vs compute with a power law."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loomax.ladder.config import Rung
from loomax.tracking.jsonl import read_metrics


def run_dirs(rung: Rung, results_dirs: Sequence[str | Path] = ()) -> list[Path]:
    """Where ``rung``'s run directory may be: its own, then ``<dir>/<name>-<size>`` of each
    of ``results_dirs`` (copies moved off the training machine)."""
    return [rung.run_dir] + [Path(d) / rung.run_dir.name for d in results_dirs]


def checkpoints_table(rungs: Sequence[Rung], results_dirs: Sequence[str | Path] = ()):
    """One row per checkpoint of every size: the planned ones (named "0.5xC", "1xC"...) and
    any other found on disk, with size, name, step, tokens, path (where it was found, the
    run directory first, then ``results_dirs``; else where it is planned), exists
    (complete) and planned."""
    import pandas as pd

    from loomax.checkpoint.discovery import list_checkpoints

    rows = []
    for r in rungs:
        found: dict[int, str] = {}
        for run_dir in run_dirs(r, results_dirs):
            if (run_dir / "checkpoints").is_dir():
                for info in list_checkpoints(str(run_dir / "checkpoints")):
                    found.setdefault(info.step, str(info.directory))
        base = r.config.trainer.checkpointer.base_path or str(r.run_dir / "checkpoints")
        for step in sorted(set(r.plan.checkpoint_steps) | set(found)):
            rows.append(
                {
                    "size": r.size,
                    "name": r.plan.checkpoint_name(step),
                    "step": step,
                    "tokens": step * r.plan.batch_tokens,
                    "path": found.get(step, str(Path(base) / f"step-{step}")),
                    "exists": step in found,
                    "planned": step in r.plan.checkpoint_steps,
                }
            )
    columns = ["size", "name", "step", "tokens", "path", "exists", "planned"]
    return pd.DataFrame(rows, columns=columns)


def metrics_table(rungs: Sequence[Rung], results_dirs: Sequence[str | Path] = ()):
    """Every logged step of every size's ``metrics.jsonl`` (from the first of ``run_dirs``
    that has one), with params, tokens and compute (6 N D, N as the budget counts it)."""
    import pandas as pd

    rows = []
    for r in rungs:
        paths = [d / "metrics.jsonl" for d in run_dirs(r, results_dirs)]
        path = next((p for p in paths if p.exists()), None)
        if path is None:
            continue
        for record in read_metrics(path):  # one record per step, even after a resume
            step = int(record["step"])
            tokens = step * r.plan.batch_tokens
            rows.append(
                {
                    "size": r.size,
                    "params": r.plan.budget_params,
                    "step": step,
                    "tokens": tokens,
                    "flops": 6.0 * r.plan.budget_params * tokens,
                    "train/loss": record.get("train/loss"),
                    "eval/loss": record.get("eval/loss"),
                }
            )
    columns = ["size", "params", "step", "tokens", "flops", "train/loss", "eval/loss"]
    return pd.DataFrame(rows, columns=columns)


def final_losses(metrics):
    """Per size, the last step's compute and loss (eval loss where there is one, else train loss)."""
    import pandas as pd

    rows = []
    for size, group in metrics.groupby("size", sort=False):
        group = group.sort_values("step")
        evals = group.dropna(subset=["eval/loss"])
        last = evals.iloc[-1] if len(evals) else group.dropna(subset=["train/loss"]).iloc[-1]
        loss = last["eval/loss"] if len(evals) else last["train/loss"]
        rows.append({"size": size, "params": last["params"], "flops": last["flops"], "loss": loss})
    return pd.DataFrame(rows, columns=["size", "params", "flops", "loss"])


def fit_power_law(compute: Sequence[float], loss: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` of ``loss = a * compute ** -b``, a least-squares line in log-log space."""
    c, y = np.asarray(compute, float), np.asarray(loss, float)
    if len(c) < 2 or np.any(c <= 0) or np.any(y <= 0):
        raise ValueError(
            f"a power law needs >= 2 points with positive compute and loss, got {len(c)}"
        )
    slope, intercept = np.polyfit(np.log(c), np.log(y), 1)
    return float(np.exp(intercept)), float(-slope)


def plot_loss_vs_compute(metrics, out: str | Path) -> tuple[Path, tuple[float, float] | None]:
    """Loss curves of every size against compute (log-log) and the power law through the final losses."""
    from loomax.optim.plot import require_pyplot

    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for size, group in metrics.groupby("size", sort=False):
        group = group[group["step"] > 0].dropna(subset=["train/loss"]).sort_values("step")
        ax.plot(group["flops"], group["train/loss"], label=f"{size} train", alpha=0.7)
    finals = final_losses(metrics) if len(metrics) else None
    fit = None
    if finals is not None and len(finals) >= 2 and (finals["flops"] > 0).all():
        fit = fit_power_law(finals["flops"], finals["loss"])
        a, b = fit
        xs = np.geomspace(finals["flops"].min(), finals["flops"].max(), 50)
        ax.scatter(finals["flops"], finals["loss"], color="black", zorder=3, label="final loss")
        ax.plot(xs, a * xs**-b, "k--", label=f"fit: {a:.3g} C^-{b:.3f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute (FLOPs, 6ND)")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out, fit
