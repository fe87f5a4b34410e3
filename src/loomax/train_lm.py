"""Train a language model: ``train_lm(config)`` runs the job a ``TrainLmConfig`` describes."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from loomax.checkpoint.checkpointer import check_writable
from loomax.config import ConfigError, flatten_config, to_json_dict, to_yaml
from loomax.data import BatchLoader, LmDatasets, build_lm_datasets, report_skipped
from loomax.data.order import choose_order
from loomax.data.sources import check_source_files
from loomax.data.streaming import check_streaming, streaming_datasets
from loomax.distributed import pod_ray_cluster
from loomax.hooks import (
    EvalHook,
    default_hooks,
    make_loss_evaluator,
    next_token_bytes,
    token_byte_lengths,
)
from loomax.lm.config import TrainLmConfig, batch_shape, resolve_vocab_size
from loomax.lm.eval_sets import eval_sets
from loomax.lm.loss import model_lm_loss
from loomax.lm.sample import sample_text
from loomax.lm.weights import check_initial_weights, initial_model, initial_weights
from loomax.mesh import batch_sharding, replicated
from loomax.models.blocks.fp8 import check_fp8
from loomax.peak_flops import total_peak_flops
from loomax.storage import to_url
from loomax.tracking import check_trackers
from loomax.train import HookContext, StepInfo, Trainer, check_restore_sources, setup_process
from loomax.train.memory_fit import check_step_fits_everywhere
from loomax.train.process import device_line
from loomax.train.shutdown import schedule_shutdown

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainLmResult:
    """What ``train_lm`` returns: the final step info, eval history and the sample."""

    final: StepInfo
    evals: list[tuple[int, dict[str, float]]]
    sample: str | None
    run_dir: Path
    num_train_steps: int | None = None
    """The steps the run was to train (``trainer.num_train_steps``, or its epochs in steps)."""
    stop_reason: str | None = None
    """Why training stopped before ``num_train_steps`` (the time guard, a signal, a hook), if it did."""


def train_lm(config: TrainLmConfig) -> TrainLmResult:
    """Run the training job described by ``config``: data, model, loop, eval, sample."""
    run_id = setup_process(config.trainer)
    try:
        return _train_lm(config, run_id)
    finally:
        if config.trainer.shutdown_at_exit is not None:
            schedule_shutdown(config.trainer.shutdown_at_exit)


def _train_lm(config: TrainLmConfig, run_id: str) -> TrainLmResult:
    trainer_config, model_config = config.trainer, config.model
    # a missing tracker package, checkpoints or weights fail now, not after the data build
    check_trackers(trainer_config.tracker)
    own_checkpoints = to_url(trainer_config.checkpoint_path(run_id))
    check_writable(own_checkpoints)
    if not check_restore_sources(trainer_config, own_checkpoints, run_id):
        check_initial_weights(config)
    check_fp8(model_config.fp8)  # only fp8 "on" looks at the devices
    check_source_files(config.data.train, config.data.validation)  # names data.train[i].urls
    if config.data.format == "chat":  # conversations: rendered, masked, packed on the host
        from loomax.data.chat.dataset import build_chat_datasets

        return _train_on(config, run_id, build_chat_datasets(config.data, model_config.seq_len))
    order = choose_order(config.data, epochs=trainer_config.num_train_epochs is not None)
    logger.info(order.describe(config.data.stream_chunk_shards))
    streaming = order.streaming
    if streaming:
        check_streaming(config.data)
        if trainer_config.num_train_epochs is not None:
            raise ConfigError(
                "trainer.num_train_epochs needs the size of an epoch, unknown while "
                "data.stream_while_building builds the cache; set trainer.num_train_steps"
            )
    with contextlib.ExitStack() as data_stack:
        # on a pod: every host's CPUs; kept while training when the caches still build
        ray_config = data_stack.enter_context(pod_ray_cluster(trainer_config.ray))
        if streaming:
            data = streaming_datasets(config.data, model_config.seq_len, ray=ray_config)
            data_stack.callback(data.close)
            data_stack = data_stack.pop_all()  # closed when training ends
        else:
            data = build_lm_datasets(config.data, model_config.seq_len, ray=ray_config)
    try:
        return _train_on(config, run_id, data)
    finally:
        data_stack.close()


def _train_on(config: TrainLmConfig, run_id: str, data: LmDatasets) -> TrainLmResult:
    trainer_config, model_config = config.trainer, config.model
    # where it runs: once the data is ready (asking for the devices starts JAX's backend,
    # which must come after the data's Ray cluster)
    if jax.process_index() == 0:
        print(device_line(trainer_config), flush=True)
    # windows built so far while streaming: no epoch size (num_train_epochs was refused)
    epoch_size = None if data.background is not None else data.num_train_windows
    trainer_config = trainer_config.with_epoch_size(epoch_size)  # num_train_epochs -> steps
    batch_sizes = trainer_config.batch_schedule
    steps = trainer_config.num_train_steps
    trainer = Trainer(
        trainer_config,
        config.optimizer.build(steps, batch_sizes),
        model_lm_loss(config),
        run_id=run_id,
        lr_schedule=config.optimizer.lr_scheduler(steps, batch_sizes),
        epoch_size=epoch_size,
        qk_clip_tau=config.optimizer.qk_clip_tau,
    )
    vocab_size = resolve_vocab_size(model_config, data.vocab_size)
    rows = trainer.runtime.row_block  # the rows of each batch this process loads
    validation = eval_sets(config, data, trainer.runtime.data_parallel_size, rows)
    loader = make_loader(config, data)

    def tokens_done(step: int) -> int:  # tokens trained on by `step`, under any batch schedule
        return batch_sizes.offset(step) * model_config.seq_len

    flops_per_token = 3 * model_config.flops_per_token(vocab_size)
    peak = total_peak_flops(trainer_config.policy.compute_dtype, trainer_config.device_peak_flops)

    eval_loss = model_lm_loss(config, training=False)
    chat = config.data.format == "chat"  # eval/loss: the held-out trained (assistant) tokens
    evaluate = make_loss_evaluator(  # the run's evaluator, shared by the eval hooks
        eval_loss,
        validation,
        trainer_config.policy,
        jit=trainer.runtime.jit,
        prepare=trainer.place_batch,
        count_bytes=None
        if chat
        else next_token_bytes(token_byte_lengths(data.tokenizer, vocab_size)),
        microbatch_rows=trainer_config.eval_microbatch_rows(trainer.runtime.data_parallel_size),
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
        trace_step=trainer.trace_step,
        write_artifact=trainer.write_artifact,
    )
    hooks = []  # the run's own hooks (trainer settings), then trainer.hooks from the YAML
    for hook_config in default_hooks(trainer_config) + list(trainer_config.hooks):
        built = hook_config.build(context)
        for hook in built if isinstance(built, list) else [built]:
            trainer.add_hook(hook)
            hooks.append(hook)
    evaluator = next(h for h in hooks if isinstance(h, EvalHook))  # the run's own eval
    if data.background is not None:  # the caches still build: at full width once training runs
        background = data.background

        def first_step_done(info: StepInfo) -> None:
            background.training_started()

        trainer.add_hook(first_step_done)

    trainer.run_config = to_json_dict(config)
    run_dir = trainer.run_dir
    trainer.tracker.log_hyperparameters(flatten_config(config))
    report_skipped(data.skipped, trainer.tracker, echo=primary)  # data/skipped_records/...
    params = model_config.param_count(vocab_size)
    logger.info(
        "model: %s, %.2fM parameters, vocab %d",
        model_config.get_choice_name(type(model_config)),
        params / 1e6,
        vocab_size,
    )
    if primary:
        print(
            f"run {trainer.run_id}: {params / 1e6:.2f}M parameters, {data.num_train_windows} train windows"
            + (" built so far" if data.background is not None else "")
            + f", run dir {run_dir}"
        )

    if trainer_config.check_memory and not trainer_config.eval_only:
        check_step_memory(trainer, config, vocab_size)  # before the state takes any memory
    try:
        state = trainer.initial_state(
            initial_model(config, vocab_size), initial_weights=initial_weights(config, vocab_size)
        )
        if trainer_config.eval_only:  # one eval of the state, no training batches read
            batches = iter(())
        else:
            batches = loader.iter_from(int(state.step), *rows)
        try:
            final = trainer.train(state, batches)
        finally:
            getattr(batches, "close", lambda: None)()  # stop the prefetch thread
        text = None
        if config.sample.enabled:
            text = sample_text(final.state.model, data.tokenizer, data.eos_id, config)
        summary = {"final_step": final.step, **final.host_metrics()}
        if evaluator.history:
            summary["eval/loss_first"] = evaluator.history[0][1]["eval/loss"]
            summary.update(evaluator.history[-1][1])
        trainer.tracker.log_summary(summary)
    finally:
        trainer.finish()
    return TrainLmResult(final, list(evaluator.history), text, run_dir, steps, trainer.stop_reason)


def check_step_memory(trainer: Trainer, config: TrainLmConfig, vocab_size: int) -> None:
    """``trainer.check_memory``: compile the first step now, from the state's shapes, and stop
    with ``StepMemoryError`` if it needs more memory than the host or devices have. The
    first step then runs this program: the check costs no second compile."""
    runtime = trainer.runtime
    rows = trainer.batch_schedule.size_at(0)
    shape = batch_shape(config, rows)  # chat SFT's packed rows have 3 channels
    if trainer.config.allow_nondivisible_batch_size and rows % runtime.data_parallel_size:
        sharding = replicated(runtime.mesh)  # as place_batch puts such a batch
    else:
        sharding = batch_sharding(runtime.mesh, len(shape))
    batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    state = trainer.abstract_state(initial_model(config, vocab_size))
    compiled = trainer.precompile(state, batch, **trainer.step_args(1))
    local = [d for d in runtime.mesh.devices.flat if d.process_index == jax.process_index()]
    need = check_step_fits_everywhere(compiled, local)
    if need is not None:
        logger.info(
            "trainer.check_memory: the step needs %.3f GiB per device (state and batch %.3f, "
            "activations and temporaries %.3f): it fits",
            need.total / 2**30,
            need.state / 2**30,
            need.temporaries / 2**30,
        )


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


__all__ = ["TrainLmResult", "check_step_memory", "make_loader", "train_lm"]
