"""Train a policy with verifiable rewards: ``train_rl(config)`` runs the job ``loomax rl`` runs.

The same ``Trainer``, hooks, checkpoints, trackers and mesh as ``train_lm`` and ``train_dpo``;
what differs is the data (prompts, ``rl.train``; the batches are rollouts of the policy,
``rl.stream``), the loss (``rl.loss``) and, optionally, a supervised warm start before it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import jax

from loomax.checkpoint.checkpointer import check_writable
from loomax.config import ConfigError, flatten_config, to_json_dict, to_yaml
from loomax.data.tokenizer import eos_id, load_tokenizer, train_bpe_tokenizer
from loomax.hooks import EvalHook, default_hooks
from loomax.lm.config import resolve_vocab_size
from loomax.lm.weights import check_initial_weights, initial_model, initial_weights
from loomax.models.lora.linear import without_adapters
from loomax.peak_flops import total_peak_flops
from loomax.rl.config import TrainRlConfig
from loomax.rl.evaluate import RlEvalHook, held_out_scores
from loomax.rl.loss import grpo_loss
from loomax.rl.rewards import check_rewards
from loomax.rl.stream import ROLLOUT_FILE, RolloutStream
from loomax.rl.tasks import read_prompts
from loomax.rl.warm_start import warm_start_model
from loomax.storage import to_url
from loomax.tracking import check_trackers
from loomax.train import HookContext, StepInfo, Trainer, check_restore_sources, setup_process
from loomax.train.process import device_line

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainRlResult:
    """What ``train_rl`` returns: the final step, the held-out scores and the stream."""

    final: StepInfo
    evals: list[tuple[int, dict[str, float]]]
    run_dir: Path
    num_train_steps: int | None = None
    stop_reason: str | None = None
    model_dir: Path | None = None


def run_tokenizer(config: TrainRlConfig, prompts, run_dir: Path):
    """``rl.tokenizer``, or a byte-level BPE trained on the train prompts and answers, kept in
    ``<run_dir>/tokenizer.json`` (read back by a resumed run)."""
    if config.rl.tokenizer is not None:
        return load_tokenizer(config.rl.tokenizer)
    path = run_dir / "tokenizer.json"
    if path.is_file():
        return load_tokenizer(path)
    texts = (t for p in prompts for t in (p.prompt, p.answer or ""))
    return train_bpe_tokenizer(texts, config.rl.tokenizer_vocab_size, path)


def train_rl(config: TrainRlConfig) -> TrainRlResult:
    """Run the RL job ``config`` describes: prompts, warm start, rollouts and updates, evaluation."""
    rl, trainer_config = config.rl, config.trainer
    if rl.train is None:
        raise ConfigError("rl.train: give a jsonl file of prompts ({prompt, answer} a line)")
    check_rewards(rl.rewards)
    run_id = setup_process(trainer_config)
    if jax.process_count() > 1:
        raise ConfigError(
            "loomax rl runs in one process for now (any number of its devices); "
            f"this run has {jax.process_count()} processes"
        )
    check_trackers(trainer_config.tracker)
    own_checkpoints = to_url(trainer_config.checkpoint_path(run_id))
    check_writable(own_checkpoints)
    resuming = check_restore_sources(trainer_config, own_checkpoints, run_id)
    if not resuming:
        check_initial_weights(config)
    if jax.process_index() == 0:
        print(device_line(trainer_config), flush=True)
    prompts = read_prompts(rl.train)
    held_out = read_prompts(rl.validation) if rl.validation else []
    if rl.max_eval_prompts is not None:
        held_out = held_out[: rl.max_eval_prompts]
    run_dir = trainer_config.run_path(run_id)
    tokenizer = run_tokenizer(config, prompts, run_dir)
    stop = eos_id(tokenizer)
    vocab_size = resolve_vocab_size(config.model, tokenizer.get_vocab_size())

    def encode(text: str) -> list[int]:
        return [stop] + tokenizer.encode(text).ids  # EOS starts a document, as in pretraining

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    init = initial_model(config, vocab_size)
    start_weights = initial_weights(config, vocab_size)
    if rl.warm_start_steps > 0:
        warm = warm_start_model(
            config,
            prompts,
            encode,
            lambda t: tokenizer.encode(t).ids,
            stop,
            init,
            run_dir,
            tokenizer,
        )
        start_weights = lambda: warm  # noqa: E731
    steps, schedule = trainer_config.num_train_steps, trainer_config.batch_schedule
    loss = grpo_loss(rl)
    trainer = Trainer(
        trainer_config,
        config.optimizer.build(steps, schedule),
        loss,
        run_id=run_id,
        lr_schedule=config.optimizer.lr_scheduler(steps, schedule),
        qk_clip_tau=config.optimizer.qk_clip_tau,
    )
    try:
        return _train(config, trainer, prompts, held_out, encode, decode, stop, vocab_size,
                      init, start_weights, tokenizer)  # fmt: skip
    finally:
        trainer.finish()


def _train(config, trainer, prompts, held_out, encode, decode, stop, vocab_size, init,
           start_weights, tokenizer):  # fmt: skip
    rl, trainer_config, model_config = config.rl, trainer.config, config.model
    policy = trainer_config.policy
    rows = trainer.batch_schedule.size_at(0)
    if not trainer.batch_schedule.is_constant:
        raise ConfigError("loomax rl: trainer.train_batch_size must be one size (no schedule)")
    seq_len = model_config.seq_len

    def score_model(model):
        return held_out_scores(
            policy.cast_to_compute(model), rl, held_out, encode, decode,
            stop_token=stop, seq_len=seq_len, mesh=trainer.mesh,
        )  # fmt: skip

    context = HookContext(
        trainer.runtime,
        trainer_config=trainer_config,
        run_dir=trainer.run_dir,
        model_config=model_config,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        validation={},
        loss_fn=trainer.loss_fn,
        evaluator=None,
        tokens_per_step=lambda step: step * rows * seq_len,
        flops_per_token=3 * model_config.flops_per_token(vocab_size),
        peak_flops=total_peak_flops(policy.compute_dtype, trainer_config.device_peak_flops),
        config_yaml=to_yaml(config),
        primary=jax.process_index() == 0,
        trace_step=trainer.trace_step,
        write_artifact=trainer.write_artifact,
    )
    reference_model = {}

    def reference():
        return reference_model["model"]

    stream = RolloutStream(
        rl, prompts, encode, decode, stop_token=stop, seq_len=seq_len, rows_per_step=rows,
        seed=trainer_config.seed, mesh=trainer.mesh, jit=trainer.runtime.jit,
        place=trainer.place_batch, cast=policy.cast_to_compute,
        reference=reference if rl.kl_beta > 0 else None,
    )  # fmt: skip
    trainer.add_hook(stream)
    evaluator = None
    if held_out:
        evaluator = RlEvalHook(
            score_model, trainer_config.steps_per_eval, trainer_config.eval_at_start
        )
        trainer.add_hook(evaluator)
    for hook_config in default_hooks(trainer_config) + list(trainer_config.hooks):
        if isinstance(hook_config, EvalHook.Config):
            continue  # held-out prompts are scored by RlEvalHook
        built = hook_config.build(context)
        for hook in built if isinstance(built, list) else [built]:
            trainer.add_hook(hook)
    trainer.run_config = to_json_dict(config)
    trainer.tracker.log_hyperparameters(flatten_config(config))
    state = trainer.initial_state(init, initial_weights=start_weights)
    if rl.kl_beta > 0:  # the reference: the base under LoRA, else the starting weights
        if model_config.lora is not None:
            reference_model["model"] = None
            stream.reference = lambda: without_adapters(stream.state.model)
        elif trainer.restored_from is None:  # a copy: the step donates the state's buffers
            reference_model["model"] = jax.tree.map(
                lambda x: x.copy() if isinstance(x, jax.Array) else x, state.model
            )
        elif rl.warm_start_steps > 0:
            reference_model["model"] = jax.tree.map(
                lambda w, s: jax.device_put(w, s.sharding),
                policy.cast_to_param(start_weights()), state.model,
            )  # fmt: skip
        else:
            raise ConfigError(
                "rl.kl_beta > 0: a resumed run needs its reference weights (rl.warm_start_steps "
                "or a LoRA run's base); this run started from other weights"
            )
    saved = None
    if trainer.restored_from is not None:
        saved = trainer.restored_from.directory.read_bytes(ROLLOUT_FILE)
    batches = stream.batches(state, int(state.step), saved)
    final = trainer.train(state, batches)
    model_dir = trainer.run_dir / "model"
    if context.primary:
        final.state.model.save(model_dir, tokenizer)
    evals = list(evaluator.history) if evaluator is not None else []
    summary = {"final_step": final.step, **final.host_metrics()}
    if evals:
        summary.update(evals[-1][1])
    trainer.tracker.log_summary(summary)
    return TrainRlResult(final, evals, trainer.run_dir, trainer_config.num_train_steps,
                         trainer.stop_reason, model_dir)  # fmt: skip


__all__ = ["TrainRlResult", "train_rl"]
