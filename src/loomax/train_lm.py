"""Train a language model: ``TrainLmConfig`` (the run YAML) and ``train_lm`` (the run)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import haliax as hax
import jax
import numpy as np
import yaml

from loomax.callbacks import (
    EvalHook,
    default_hooks,
    make_loss_evaluator,
    next_token_bytes,
    token_byte_lengths,
)
from loomax.config import to_yaml
from loomax.data import BatchLoader, DataConfig, LmDatasets, build_lm_datasets, eval_batches
from loomax.data.loader import process_rows
from loomax.distributed import pod_ray_cluster
from loomax.models import Gpt2Config, LmConfig, next_token_loss
from loomax.models.attention import segment_ids_from_eos
from loomax.models.axes import Batch, Position
from loomax.models.generate import sample_tokens
from loomax.optim import AdamConfig, OptimizerConfig
from loomax.peak_flops import total_peak_flops
from loomax.train import HookContext, StepInfo, Trainer, TrainerConfig, setup_process

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleConfig:
    """A text sample printed at the end of training."""

    enabled: bool = True
    """Generate a sample after training."""
    prompt: str = "def "
    """Text the sample starts from."""
    max_new_tokens: int = 64
    """Tokens to generate."""
    temperature: float = 0.8
    """Softmax temperature; 0 = greedy."""


@dataclass(frozen=True)
class TrainLmConfig:
    """A whole training run: data, model, optimizer, trainer (and the closing sample)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Where the text comes from and how it is tokenized."""
    model: LmConfig = field(default_factory=Gpt2Config)
    """The model (`type`: gpt2)."""
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    """The optimizer and its learning-rate schedule (`type`: adam)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, batch, precision, logging and evaluation."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """What to generate once training is done."""


@dataclass(frozen=True)
class TrainLmResult:
    """What ``train_lm`` returns: the final step info, eval history and the sample."""

    final: StepInfo
    evals: list[tuple[int, dict[str, float]]]
    sample: str | None
    run_dir: Path


def lm_loss(
    block_size: int | None = 4096,
    *,
    z_loss_weight: float = 0.0,
    eos_id: int | None = None,
    vocab_block_size: int | None = None,
):
    """The trainer's loss: next-token cross-entropy on a ``[batch, position]`` token array.

    With ``eos_id``, attention stays within the documents packed into each sequence.
    """

    def loss_fn(model, tokens, *, key=None):
        tokens = hax.auto_sharded(
            hax.named(tokens, (Batch, Position))
        )  # batch over (replica, data)
        segments = None if eos_id is None else segment_ids_from_eos(tokens, eos_id)
        return next_token_loss(
            model,
            tokens,
            block_size=block_size,
            z_loss_weight=z_loss_weight,
            segment_ids=segments,
            vocab_block_size=vocab_block_size,
        )

    return loss_fn


def model_lm_loss(config: TrainLmConfig, *, training: bool = True):
    """``lm_loss`` as ``config.model`` asks (block size, document masking with the tokenizer's EOS,
    and z-loss when ``training``: evaluation reports the plain cross-entropy)."""
    model = config.model
    eos = None
    if model.document_mask:
        from loomax.data.dataset import prepare_tokenizer
        from loomax.data.tokenizer import eos_id, load_tokenizer

        eos = eos_id(load_tokenizer(prepare_tokenizer(config.data)))
    z_loss = model.z_loss_weight if training else 0.0
    return lm_loss(
        model.cross_entropy_block_size,
        z_loss_weight=z_loss,
        eos_id=eos,
        vocab_block_size=model.cross_entropy_vocab_block_size,
    )


def train_lm(config: TrainLmConfig) -> TrainLmResult:
    """Run the training job described by ``config``: data, model, loop, eval, sample."""
    trainer_config, model_config = config.trainer, config.model
    batch_sizes = trainer_config.batch_schedule
    optimizer = config.optimizer.build(trainer_config.num_train_steps, batch_sizes)
    loss_fn = model_lm_loss(config)
    run_id = setup_process(trainer_config)
    trainer = Trainer(
        trainer_config,
        optimizer,
        loss_fn,
        run_id=run_id,
        lr_schedule=config.optimizer.lr_scheduler(trainer_config.num_train_steps, batch_sizes),
    )

    with pod_ray_cluster(trainer_config.ray) as ray_config:  # on a pod: every host's CPUs
        data = build_lm_datasets(config.data, model_config.seq_len, ray=ray_config)
    vocab_size = _resolve_vocab_size(model_config, data.vocab_size)
    validation = _eval_sets(config, data, trainer.runtime.data_parallel_size)
    loader = make_loader(config, data)

    def tokens_done(step: int) -> int:  # tokens trained on by `step`, under any batch schedule
        return batch_sizes.offset(step) * model_config.seq_len

    flops_per_token = 3 * model_config.flops_per_token(vocab_size)
    peak = total_peak_flops(trainer_config.policy.compute_dtype, trainer_config.device_peak_flops)

    eval_loss = model_lm_loss(config, training=False)
    evaluate = make_loss_evaluator(  # the run's evaluator, shared by the eval hooks
        eval_loss,
        validation,
        trainer_config.policy,
        jit=trainer.runtime.jit,
        prepare=trainer.runtime.shard_batch,
        count_bytes=next_token_bytes(token_byte_lengths(data.tokenizer, vocab_size)),
    )
    primary = jax.process_index() == 0  # only process 0 prints and writes shared files
    config_yaml = to_yaml(config)
    context = HookContext(
        trainer.runtime,
        trainer_config=trainer_config,
        run_dir=trainer.run_dir,
        model_config=model_config,
        vocab_size=vocab_size,
        tokenizer=data.tokenizer,
        validation=validation if isinstance(validation, dict) else {"validation": validation},
        loss_fn=eval_loss,
        evaluator=evaluate,
        tokens_per_step=tokens_done,
        flops_per_token=flops_per_token,
        peak_flops=peak,
        config_yaml=config_yaml,
        primary=primary,
    )
    hooks = []  # the run's own hooks (trainer settings), then trainer.hooks from the YAML
    for hook_config in default_hooks(trainer_config) + list(trainer_config.hooks):
        built = hook_config.build(context)
        for hook in built if isinstance(built, list) else [built]:
            trainer.add_hook(hook)
            hooks.append(hook)
    evaluator = next(h for h in hooks if isinstance(h, EvalHook))  # the run's own eval

    trainer.run_config = json.loads(json.dumps(yaml.safe_load(config_yaml), default=str))
    run_dir = trainer.run_dir
    trainer.tracker.log_hyperparameters(_flat_config(config))
    params = model_config.param_count(vocab_size)
    logger.info(
        "model: %s, %.2fM parameters, vocab %d",
        model_config.get_choice_name(type(model_config)),
        params / 1e6,
        vocab_size,
    )
    if primary:
        print(
            f"run {trainer.run_id}: {params / 1e6:.2f}M parameters, {data.num_train_windows} train windows, run dir {run_dir}"
        )

    try:
        state = trainer.initial_state(
            initial_model(config, vocab_size), initial_weights=initial_weights(config, vocab_size)
        )
        batches = loader.iter_from(int(state.step), jax.process_index(), jax.process_count())
        try:
            final = trainer.train(state, batches)
        finally:
            getattr(batches, "close", lambda: None)()  # stop the prefetch thread
        text = None
        if config.sample.enabled:
            text = _sample(final, data, config)
        summary = {"final_step": final.step, **final.host_metrics()}
        if evaluator.history:
            summary["eval/loss_first"] = evaluator.history[0][1]["eval/loss"]
            summary.update(evaluator.history[-1][1])
        trainer.tracker.log_summary(summary)
    finally:
        trainer.finish()
    return TrainLmResult(final, list(evaluator.history), text, run_dir)


def make_loader(config: TrainLmConfig, data: LmDatasets) -> BatchLoader:
    """The training batch loader of a run: one dataset per train source, mixed by weight."""
    seed = config.data.shuffle_seed if config.data.shuffle_seed is not None else config.trainer.seed
    return BatchLoader(
        data.train,
        config.trainer.batch_schedule,
        seed=seed,
        shuffle=config.data.shuffle,
        weights=[source.weight for source in config.data.train],
        weight_schedule=[(stage.start, stage.weights) for stage in config.data.weight_schedule],
        prefetch=config.data.prefetch,
    )


def initial_model(config: TrainLmConfig, vocab_size: int):
    """``init(key) -> model``: the fresh weights of ``config.model``."""
    return lambda key: config.model.build(vocab_size, key=key)


def initial_weights(config: TrainLmConfig, vocab_size: int):
    """``load() -> model`` for ``trainer.initialize_from_hf`` (None without it).

    The trainer calls it only when the run does not resume from its own checkpoint.
    """
    path = config.trainer.initialize_from_hf
    if path is None:
        return None

    def load():
        from loomax.hf import load_hf

        try:
            model = load_hf(path, config.model)
        except ValueError as e:
            raise ValueError(f"trainer.initialize_from_hf: {e}") from e
        if model.Vocab.size != vocab_size:
            raise ValueError(
                f"trainer.initialize_from_hf: {path} has a vocabulary of {model.Vocab.size}, the run {vocab_size}; "
                f"set model.vocab_size: {model.Vocab.size} (and use the checkpoint's tokenizer)"
            )
        logger.info("model weights from the Hugging Face checkpoint %s", path)
        return model

    return load


def _eval_sets(
    config: TrainLmConfig, data: LmDatasets, dp: int
) -> list[np.ndarray] | dict[str, list[np.ndarray]]:
    """This process's rows of the eval batches: one list, or ``{name: batches}`` per validation source when there are several."""
    size = config.trainer.eval_batch_size or config.trainer.batch_schedule.sizes[0]
    limit = config.trainer.max_eval_batches
    sets: dict[str, list[np.ndarray]] = {}
    if len(data.validation_sets) > 1:
        sources = config.data.validation or config.data.train
        for i, (source, windows) in enumerate(zip(sources, data.validation_sets, strict=True)):
            name = _source_name(source, i)
            while name in sets:
                name += "_"
            if len(windows) == 0:
                logger.warning("validation set %s has no whole window: not evaluated", name)
                continue
            sets[name] = eval_batches(windows, size, limit)
    if not sets:
        sets[""] = eval_batches(data.validation, size, limit)
    sizes = sorted({len(b) for batches in sets.values() for b in batches})
    if any(n % dp for n in sizes):
        raise ValueError(
            f"eval batches of {sizes} sequences do not split over the data-parallel "
            f"size {dp}: set trainer.eval_batch_size to a multiple of {dp} (and give data.validation at least that many windows)"
        )
    rows = lambda b: b[process_rows(len(b), jax.process_index(), jax.process_count())]  # noqa: E731
    out = {name: [rows(b) for b in batches] for name, batches in sets.items()}
    return out[""] if "" in out else out


def _source_name(source, index: int) -> str:
    """A short metric-safe name for a data source: its file stem, dataset id or embedded corpus."""
    if source.urls:
        name = Path(source.urls[0]).name.split(".")[0]
    elif source.hf is not None:
        name = source.hf.id.rsplit("/", 1)[-1]
    elif source.embedded:
        name = source.embedded
    else:
        name = ""
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_")
    return name or f"set{index}"


def _resolve_vocab_size(model_config: LmConfig, tokenizer_vocab: int) -> int:
    if model_config.vocab_size is None:
        return tokenizer_vocab
    if model_config.vocab_size < tokenizer_vocab:
        raise ValueError(
            f"model.vocab_size ({model_config.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab}); raise it or set it to null"
        )
    return model_config.vocab_size


def _sample(final: StepInfo, data, config: TrainLmConfig) -> str:
    prompt = data.tokenizer.encode(config.sample.prompt).ids or [data.eos_id]
    tokens = sample_tokens(
        config.trainer.policy.cast_to_compute(final.state.model),
        prompt,
        seq_len=config.model.seq_len,
        max_new_tokens=config.sample.max_new_tokens,
        temperature=config.sample.temperature,
        key=jax.random.PRNGKey(config.trainer.seed + 1),
    )
    return data.tokenizer.decode(tokens)


def _flat_config(config: Any) -> dict[str, Any]:
    def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
        else:
            out[prefix] = value

    out: dict[str, Any] = {}
    flatten("", yaml.safe_load(to_yaml(config)), out)
    return json.loads(json.dumps(out, default=str))


__all__ = ["SampleConfig", "TrainLmConfig", "TrainLmResult", "lm_loss", "model_lm_loss", "train_lm"]
