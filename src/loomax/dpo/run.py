"""Train a policy on preference pairs: ``train_dpo(config)`` runs the job ``loomax dpo`` runs.

The same ``Trainer``, hooks, checkpoints, trackers and mesh as ``train_lm``; what differs
is the data (pairs: ``dpo.train``, ``dpo.validation``), the loss (``dpo.loss``) and one
pass before training that computes the reference log-probs (``dpo.reference_cache``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from loomax.checkpoint.checkpointer import check_writable
from loomax.config import ConfigError, flatten_config, to_json_dict, to_yaml
from loomax.dpo.config import TrainDpoConfig
from loomax.dpo.data import chat_template, run_tokenizer, tokenizer_eos, train_batches
from loomax.dpo.loss import dpo_loss
from loomax.dpo.pairs import PairArrays, fill_column, pair_batches, read_pairs, tokenize_pairs
from loomax.dpo.reference import compute_reference, reference_logps
from loomax.hooks import EvalHook, default_hooks, make_loss_evaluator
from loomax.lm.config import resolve_vocab_size
from loomax.lm.weights import check_initial_weights, initial_model, initial_weights
from loomax.mesh import batch_sharding, replicated
from loomax.peak_flops import total_peak_flops
from loomax.storage import to_url
from loomax.tracking import check_trackers
from loomax.train import HookContext, StepInfo, Trainer, check_restore_sources, setup_process
from loomax.train.memory_fit import check_step_fits_everywhere
from loomax.train.process import device_line

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainDpoResult:
    """What ``train_dpo`` returns: the final step, the eval history and the baseline."""

    final: StepInfo
    evals: list[tuple[int, dict[str, float]]]
    run_dir: Path
    reference_accuracy: float | None = None
    """Held-out pairs whose chosen response the reference itself prefers (log π_ref(chosen) >
    log π_ref(rejected)): the policy's preference accuracy before training; None without
    held-out pairs or a reference."""
    num_train_steps: int | None = None
    """The steps the run was to train (``trainer.num_train_steps``, or its epochs in steps)."""
    stop_reason: str | None = None
    """Why training stopped before ``num_train_steps``, if it did."""
    model_dir: Path | None = None
    """The trained policy saved with its tokenizer (``model.save``): ``<run_dir>/model``."""


def train_dpo(config: TrainDpoConfig) -> TrainDpoResult:
    """Run the DPO job ``config`` describes: pairs, reference pass, training, evaluation."""
    dpo, trainer_config = config.dpo, config.trainer
    if dpo.train is None:
        raise ConfigError("dpo.train: give a jsonl file of preference pairs")
    run_id = setup_process(trainer_config)
    if jax.process_count() > 1:  # pairs are loaded whole and placed as one process's rows
        raise ConfigError(
            "loomax dpo runs in one process for now (any number of its devices); "
            f"this run has {jax.process_count()} processes"
        )
    check_trackers(trainer_config.tracker)
    own_checkpoints = to_url(trainer_config.checkpoint_path(run_id))
    check_writable(own_checkpoints)
    if not check_restore_sources(trainer_config, own_checkpoints, run_id):
        check_initial_weights(config)
    if jax.process_index() == 0:  # the run's first line: where it runs
        print(device_line(trainer_config), flush=True)
    # every pair is read and checked before any model work
    pairs = {"train": read_pairs(dpo.train)}
    if dpo.validation is not None:
        pairs["validation"] = read_pairs(dpo.validation)
    run_dir = trainer_config.run_path(run_id)
    tokenizer = run_tokenizer(dpo, pairs["train"], run_dir)
    eos, seq_len = tokenizer_eos(tokenizer), config.model.seq_len
    template = chat_template(dpo, pairs, tokenizer, run_dir)
    sets = {
        k: tokenize_pairs(v, tokenizer, eos, seq_len, dpo.max_prompt_len, template)
        for k, v in pairs.items()
    }
    vocab_size = resolve_vocab_size(config.model, tokenizer.get_vocab_size())
    trainer_config = trainer_config.with_epoch_size(len(sets["train"]))
    schedule, steps = trainer_config.batch_schedule, trainer_config.num_train_steps
    trainer = Trainer(
        trainer_config,
        config.optimizer.build(steps, schedule),
        dpo_loss(dpo),
        run_id=run_id,
        lr_schedule=config.optimizer.lr_scheduler(steps, schedule),
        epoch_size=len(sets["train"]),
        qk_clip_tau=config.optimizer.qk_clip_tau,
    )
    try:
        return _train(config, trainer, sets, tokenizer, vocab_size)
    finally:
        trainer.finish()


def _train(
    config: TrainDpoConfig,
    trainer: Trainer,
    sets: dict[str, PairArrays],
    tokenizer,
    vocab_size: int,
):
    dpo, trainer_config, model_config = config.dpo, trainer.config, config.model
    schedule = trainer_config.batch_schedule
    validation = []  # held-out batches; their reference columns are filled after the pass
    if "validation" in sets:
        n = len(sets["validation"])
        zeros = {"ref_chosen": np.zeros(n, np.float32), "ref_rejected": np.zeros(n, np.float32)}
        extra = zeros if dpo.cached_reference else None
        validation = pair_batches(sets["validation"], schedule.size_at(0), extra)
    pair_tokens = 2 * model_config.seq_len  # a pair's two rows

    context = HookContext(
        trainer.runtime,
        trainer_config=trainer_config,
        run_dir=trainer.run_dir,
        model_config=model_config,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        validation={"validation": validation} if validation else {},
        loss_fn=dpo_loss(dpo),
        evaluator=make_loss_evaluator(
            dpo_loss(dpo),
            validation,
            trainer_config.policy,
            jit=trainer.runtime.jit,
            prepare=trainer.place_batch,
        )
        if validation
        else None,
        tokens_per_step=lambda step: schedule.offset(step) * pair_tokens,
        flops_per_token=3 * model_config.flops_per_token(vocab_size),
        peak_flops=total_peak_flops(
            trainer_config.policy.compute_dtype, trainer_config.device_peak_flops
        ),
        config_yaml=to_yaml(config),
        primary=jax.process_index() == 0,
        trace_step=trainer.trace_step,
        write_artifact=trainer.write_artifact,
    )
    hooks = []
    for hook_config in default_hooks(trainer_config) + list(trainer_config.hooks):
        if isinstance(hook_config, EvalHook.Config) and context.evaluator is None:
            continue  # no held-out pairs: nothing to evaluate
        built = hook_config.build(context)
        for hook in built if isinstance(built, list) else [built]:
            trainer.add_hook(hook)
            hooks.append(hook)
    trainer.run_config = to_json_dict(config)
    trainer.tracker.log_hyperparameters(flatten_config(config))
    init = initial_model(config, vocab_size)
    if trainer_config.check_memory and not trainer_config.eval_only:
        check_dpo_step_memory(trainer, init, model_config.seq_len)  # before the state exists
    state = trainer.initial_state(init, initial_weights=initial_weights(config, vocab_size))
    reference, baseline = None, None
    if dpo.cached_reference:  # one pass of the starting weights over every pair, cached
        model, rows = state.model, schedule.size_at(0)

        def compute():
            return compute_reference(
                model,
                sets,
                rows,
                jit=trainer.runtime.jit,
                place=trainer.place_batch,
                cast=trainer_config.policy.cast_to_compute,
            )

        path = Path(dpo.reference_cache or trainer.run_dir / "dpo_reference.npz")
        resumed = trainer.restored_from is not None
        primary = jax.process_index() == 0
        reference = reference_logps(path, sets, None if resumed else compute, save=primary)
        if validation:
            chosen, rejected = reference["validation/chosen"], reference["validation/rejected"]
            fill_column(validation, "ref_chosen", chosen)
            fill_column(validation, "ref_rejected", rejected)
            baseline = float(np.mean(chosen > rejected))
    if baseline is not None:
        logger.info(
            "dpo: the reference prefers the chosen response of %.1f%% of held-out pairs",
            100 * baseline,
        )
    batches = train_batches(
        sets["train"], reference, schedule, seed=trainer_config.seed, start_step=int(state.step)
    )
    final = trainer.train(state, batches)
    model_dir = trainer.run_dir / "model"
    if context.primary:  # the policy with its tokenizer: what loomax export|generate|eval read
        final.state.model.save(model_dir, tokenizer)
    evaluator = next((h for h in hooks if isinstance(h, EvalHook)), None)
    evals = list(evaluator.history) if evaluator is not None else []
    summary = {"final_step": final.step, **final.host_metrics()}
    if evals:
        summary.update(evals[-1][1])
    if baseline is not None:
        summary["dpo/reference_accuracy"] = baseline
    trainer.tracker.log_summary(summary)
    return TrainDpoResult(
        final,
        evals,
        trainer.run_dir,
        baseline,
        trainer_config.num_train_steps,
        trainer.stop_reason,
        model_dir,
    )


def check_dpo_step_memory(trainer: Trainer, init, seq_len: int) -> None:
    """``trainer.check_memory`` for a DPO step: compiled now from the state's shapes and a
    batch of pairs (with reference columns), refused in one line if it will not fit; the
    first step then runs this program."""
    runtime = trainer.runtime
    rows = trainer.batch_schedule.size_at(0)
    nondivisible = (
        trainer.config.allow_nondivisible_batch_size and rows % runtime.data_parallel_size
    )

    def struct(shape, dtype):
        sharding = (
            replicated(runtime.mesh) if nondivisible else batch_sharding(runtime.mesh, len(shape))
        )
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    batch = {
        "chosen": struct((rows, seq_len), np.int32),
        "chosen_mask": struct((rows, seq_len), np.float32),
        "rejected": struct((rows, seq_len), np.int32),
        "rejected_mask": struct((rows, seq_len), np.float32),
        "valid": struct((rows,), np.float32),
    }
    if trainer.loss_fn.uses_reference:
        batch["ref_chosen"] = struct((rows,), np.float32)
        batch["ref_rejected"] = struct((rows,), np.float32)
    compiled = trainer.precompile(trainer.abstract_state(init), batch, **trainer.step_args(1))
    local = [d for d in runtime.mesh.devices.flat if d.process_index == jax.process_index()]
    need = check_step_fits_everywhere(compiled, local)
    if need is not None:
        logger.info(
            "trainer.check_memory: the DPO step needs %.3f GiB per device: it fits",
            need.total / 2**30,
        )


__all__ = ["TrainDpoResult", "check_dpo_step_memory", "train_dpo"]
