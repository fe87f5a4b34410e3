"""``loomax ladder dry-run|run|results|benchmark``: plan, train, compare and time the sizes of a ladder."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import jax

from loomax.errors import UserError
from loomax.ladder.config import LadderConfig, Rung, base_run, rung


def rungs_of(
    ladder: LadderConfig, ladder_path: str | None, sizes: list[str] | None = None
) -> list[Rung]:
    """The rungs of ``sizes`` (default: all), planned for the local device count."""
    base = base_run(ladder, ladder_path)
    devices = ladder.devices or jax.device_count()
    return [rung(ladder, s, base=base, devices=devices) for s in (sizes or ladder.sizes)]


def describe(r: Rung) -> str:
    """The dry run's text for one rung."""
    p, m, t = r.plan, r.config.model, r.config.trainer
    o = r.config.optimizer
    lines = [
        f"size {r.size}: {type(m).__name__} hidden_dim {m.hidden_dim}, num_layers {m.num_layers}, "
        f"num_heads {m.num_heads}, seq_len {m.seq_len}",
        f"  parameters      {p.params:,} ({p.params / 1e6:.2f}M, embeddings included); "
        f"budget N {p.budget_params:,} ({p.budget_params / 1e6:.2f}M)",
        f"  batch size      {p.batch_size} sequences = {p.batch_tokens:,} tokens per step",
        f"  duration        {p.num_train_steps:,} steps = {p.tokens:,} tokens "
        f"({p.tokens / p.params:.1f} tokens/param), {p.flops:.3g} FLOPs",
        f"  optimizer       {o.get_choice_name(type(o))}, peak lr {o.learning_rate:.4g}, "
        f"weight_decay {o.weight_decay}, warmup {o.warmup} steps",
        f"  devices         minimal mesh {r.min_devices} device(s); this run: trainer.mesh {t.mesh}, "
        f"per_device_parallelism {t.per_device_parallelism}",
        "  checkpoints     "
        + ", ".join(
            f"{p.checkpoint_name(s)} step {s} ({s * p.batch_tokens:,} tokens)"
            for s in p.checkpoint_steps
        ),
        f"  run dir         {t.run_dir}",
        "  schedule:",
    ]
    if p.cycle_peaks:
        lines.append("  stepped peaks   " + ", ".join(f"x{m:.3f}" for m in p.cycle_peaks))
    schedule = o.lr_scheduler(t.num_train_steps)
    lines += [f"    {phase}" for phase in schedule.phases()]
    return "\n".join(lines)


def ladder_command(
    action: str, args: list[str], *, parser: argparse.ArgumentParser, load: Callable
) -> None:
    """``loomax ladder ACTION``; ``parser`` comes from the CLI (with ``--config_path``), ``load``
    parses a config class; bad input raises ``UserError``."""
    parser.add_argument("--size", default=None, help="only this size (one of ladder.sizes)")
    parser.add_argument(
        "--out", default=None, metavar="PNG", help="plot to write (dry-run, results)"
    )
    parser.add_argument(
        "--steps", type=int, default=10, metavar="N", help="timed steps (benchmark)"
    )
    known, rest = parser.parse_known_args(args)
    ladder: LadderConfig = load(LadderConfig, known.config_path, rest)
    path = known.config_path
    if known.size is not None and known.size not in ladder.sizes:
        raise UserError(f"--size {known.size} is not one of ladder.sizes {ladder.sizes}")
    if action == "benchmark" and known.size is None:
        raise UserError("loomax ladder benchmark needs --size (one of ladder.sizes)")
    if known.steps < 1:
        raise UserError(f"--steps must be >= 1, got {known.steps}")
    sizes = [known.size] if known.size else None
    rungs = rungs_of(ladder, path, sizes)
    if action == "benchmark":
        _benchmark(rungs[0], known.steps)
    elif action == "dry-run":
        _dry_run(rungs, known.out)
    elif action == "run":
        _run(rungs)
    else:
        _results(ladder, rungs_of(ladder, path), known.out)


def _dry_run(rungs: list[Rung], out: str | None) -> None:
    from loomax.optim.plot import plot_schedule

    for r in rungs:
        print(describe(r))
        png = (
            Path(out) if out and len(rungs) == 1 else r.run_dir.parent / f"{r.run_dir.name}-lr.png"
        )
        plot_schedule(
            r.config.optimizer.lr_scheduler(r.plan.num_train_steps),
            r.plan.num_train_steps,
            png,
            title=f"{r.run_dir.name}: learning rate",
        )
        print(f"  lr plot         {png}")


def _run(rungs: list[Rung]) -> None:
    from loomax.train_lm import train_lm

    for r in rungs:
        print(describe(r))
        result = train_lm(r.config)
        if result.evals:
            print(f"size {r.size}: eval loss {result.evals[-1][1]['eval/loss']:.4f}")


def _benchmark(r: Rung, steps: int) -> None:
    """``loomax bench`` on the rung's run (its model, batch, micro-batches and mesh): random
    tokens, no checkpoints or evals, ``steps`` timed steps, then stop."""
    from dataclasses import replace

    from loomax.benchmark import run_benchmark

    print(describe(r))
    model = replace(r.config.model, vocab_size=r.vocab_size)
    run_benchmark(replace(r.config, model=model), steps=steps)


def _results(ladder: LadderConfig, rungs: list[Rung], out: str | None) -> None:
    import pandas as pd

    from loomax.ladder.results import checkpoints_table, metrics_table, plot_loss_vs_compute

    with pd.option_context("display.width", 200, "display.max_colwidth", 80):
        print("checkpoints:")
        print(checkpoints_table(rungs, ladder.results_dirs).to_string(index=False))
        metrics = metrics_table(rungs, ladder.results_dirs)
        if metrics.empty:
            print(f"no metrics yet under {ladder.run_root}")
            return
        print("metrics:")
        print(metrics.to_string(index=False))
    png = Path(out) if out else Path(ladder.run_root) / f"{ladder.name}-loss-vs-compute.png"
    png, fit = plot_loss_vs_compute(metrics, png)
    if fit is not None:
        print(f"power law: loss = {fit[0]:.4g} * C^-{fit[1]:.4f}")
    print(f"plot: {png}")
