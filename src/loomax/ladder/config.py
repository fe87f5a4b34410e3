"""The ladder YAML: sizes, a model configurator, a run configurator, and the base run."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from loomax.checkpoint import CheckpointerConfig, KeepPolicy
from loomax.config import ConfigError, parse_config
from loomax.ladder.model import Gpt2Configurator, ModelConfigurator
from loomax.ladder.run import ChinchillaRunConfigurator, RunConfigurator, RunPlan
from loomax.ladder.sizes import non_embedding_params, parse_size
from loomax.lm import TrainLmConfig
from loomax.mesh import MeshConfig


@dataclass(frozen=True)
class LadderConfig:
    """A model ladder: one run per size, each with a scaling-law budget."""

    name: str = "ladder"
    """Name of the ladder; runs are <run_root>/<name>-<size>."""
    sizes: list[str] = field(default_factory=lambda: ["10M", "30M", "60M", "150M"])
    """Non-embedding parameter counts, e.g. [10M, 30M, 60M, 150M]."""
    model: ModelConfigurator = field(default_factory=Gpt2Configurator)
    """Size -> model config (type: gpt2 or llama), micro-batch and minimal mesh."""
    run: RunConfigurator = field(default_factory=ChinchillaRunConfigurator)
    """Size -> tokens, batch, learning rate, schedule and checkpoints (type: chinchilla)."""
    base_config: str | None = None
    """A run YAML every rung starts from (data, tokenizer, tracker, optimizer betas...); relative to the ladder file; null = defaults."""
    run_root: str = "runs/ladder"
    """Directory of the rungs' run directories."""
    devices: int | None = None
    """Devices a run uses (for micro-batches); null = all local devices."""
    project: str | None = None
    """Tracker project of every rung (wandb project; the ladder name is the group); null = the base config's."""
    results_dirs: list[str] = field(default_factory=list)
    """More folders holding copies of the rungs' run directories (<dir>/<name>-<size>), searched by results after run_root."""

    def __post_init__(self):
        if not self.sizes:
            raise ValueError("ladder.sizes must name at least one size, e.g. [10M, 30M]")
        for size in self.sizes:
            parse_size(size)
        if len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"ladder.sizes has duplicates: {self.sizes}")


@dataclass(frozen=True)
class Rung:
    """One size of a ladder, fully decided: the plan and the run config that trains it."""

    size: str
    plan: RunPlan
    config: TrainLmConfig
    min_devices: int
    vocab_size: int
    """The vocabulary the plan counted (the tokenizer's, model.vocab_size or 50257)."""

    @property
    def run_dir(self) -> Path:
        return Path(self.config.trainer.run_dir)


def run_name(ladder: LadderConfig, size: str) -> str:
    return f"{ladder.name}-{size}"


def base_run(ladder: LadderConfig, ladder_path: str | Path | None = None) -> TrainLmConfig:
    """The base run config (``base_config`` resolved against the ladder file's folder)."""
    if ladder.base_config is None:
        return TrainLmConfig()
    path = Path(ladder.base_config)
    if not path.is_absolute() and ladder_path is not None:
        path = Path(ladder_path).parent / path
    return parse_config(TrainLmConfig, str(path), [])


def rung(
    ladder: LadderConfig,
    size: str,
    *,
    base: TrainLmConfig | None = None,
    vocab_size: int | None = None,
    devices: int = 1,
) -> Rung:
    """The plan and run config of ``size`` (``vocab_size`` only sizes the parameter count)."""
    if size not in ladder.sizes:
        raise ConfigError(f"--size {size} is not one of ladder.sizes {ladder.sizes}")
    base = base or TrainLmConfig()
    model = ladder.model.model_config(size)
    trained = base.data.tokenizer_vocab_size if base.data.tokenizer is None else None
    vocab = model.vocab_size or vocab_size or base.model.vocab_size or trained or 50257
    params = model.param_count(vocab)
    plan = ladder.run.plan(params, ladder.model.seq_len, non_embedding_params(model, vocab))
    schedule = dict(
        learning_rate=plan.learning_rate,
        warmup=plan.warmup,
        min_lr_ratio=0.0 if plan.cycles else 0.1,
        lr_schedule="linear" if plan.cycles else "cosine",
        cycles=plan.cycles,
        cycle_length=None,
        decay=plan.decay_fraction if plan.cycles else None,
        rewarmup=0,
        cycle_peaks=plan.cycle_peaks,
    )
    optimizer = replace(base.optimizer, **schedule)
    keep = [KeepPolicy(every=s, until=s) for s in plan.checkpoint_steps]
    run_dir = str(Path(ladder.run_root) / run_name(ladder, size))
    trainer = replace(
        base.trainer,
        num_train_steps=plan.num_train_steps,
        train_batch_size=plan.batch_size,
        per_device_parallelism=ladder.model.micro_batch(plan.batch_size, devices),
        run_id=run_name(ladder, size),
        run_dir=run_dir,
        checkpointer=replace(
            base.trainer.checkpointer or CheckpointerConfig(), base_path=None, keep=keep
        ),
        mesh=base.trainer.mesh if ladder.devices is None else MeshConfig(1, ladder.devices, 1),
        tracker=_with_project(base.trainer.tracker, ladder.project, ladder.name),
    )
    config = replace(base, model=model, optimizer=optimizer, trainer=trainer)
    return Rung(size, plan, config, ladder.model.min_devices(params), vocab)


def _with_project(tracker, project: str | None, group: str):
    """``tracker`` (one config or a list) with ``project`` and ``group`` on every tracker
    that has them (wandb); unchanged when ``project`` is null."""
    if project is None:
        return tracker
    trackers = tracker if isinstance(tracker, list) else [tracker]
    out, applied = [], False
    for t in trackers:
        names = {f.name for f in fields(t)}
        if "project" in names:
            t = replace(t, project=project, **({"group": group} if "group" in names else {}))
            applied = True
        out.append(t)
    if not applied:
        raise ConfigError(
            "ladder.project: no tracker of the base config has a project "
            "(trainer.tracker: add {type: wandb})"
        )
    return out if isinstance(tracker, list) else out[0]
