"""``loomax bench``: time the jitted train step of a run config on synthetic batches."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np

from loomax._xla_flags import hlo_fingerprint, library_calls
from loomax.config import ConfigError
from loomax.lm import TrainLmConfig
from loomax.lm.loss import lm_loss_for
from loomax.models.blocks.fp8 import check_fp8
from loomax.peak_flops import measure_matmul_flops, total_peak_flops
from loomax.train import Trainer, setup_process

PROFILE_STEPS = 3
"""Steps traced by ``run_benchmark(profile_dir=...)``, after the timed ones."""


def run_benchmark(
    config: TrainLmConfig,
    *,
    steps: int = 10,
    warmup: int = 2,
    save_every: int | None = None,
    profile_dir: str | None = None,
) -> dict[str, float]:
    """Compile the step, run ``warmup`` untimed steps, then time ``steps`` steps.

    Prints a human-readable report and, last, one JSON line with ``compile_s``,
    ``step_ms_median``, ``tokens_per_second``, ``flops_per_token`` (causal attention
    counted as half the score matrix) and ``mfu``, ``flops_per_token_full_attention`` (the
    full square, for figures counted that way), and the device's peak memory where it
    reports one. With ``save_every`` K, the steps are timed
    again while an async checkpoint is saved every K steps (to a temporary directory), and
    the two mean step times are compared. With ``profile_dir``, ``PROFILE_STEPS`` more
    steps are traced there by ``jax.profiler`` (TensorBoard's xplane and a Perfetto
    ``*.trace.json.gz``). A model with ``document_mask`` masks documents at a synthetic
    EOS id (the last of the vocabulary), so the masked attention path is what is timed.
    """
    model_config = config.model
    vocab_size = model_config.vocab_size
    if vocab_size is None:
        raise ConfigError(
            "loomax bench needs model.vocab_size (it uses random token ids, no tokenizer)"
        )
    scratch = tempfile.mkdtemp(prefix="loomax-bench-")
    trainer_config = config.trainer.for_scratch_run(scratch)
    trainer = Trainer(
        trainer_config,
        config.optimizer.build(trainer_config.num_train_steps),
        lm_loss_for(model_config, eos_id=vocab_size - 1 if model_config.document_mask else None),
        run_id=setup_process(trainer_config),
        lr_schedule=config.optimizer.lr_scheduler(trainer_config.num_train_steps),
    )
    # a batch-size schedule is timed at its first stage
    batch_size, seq_len = trainer_config.batch_schedule.sizes[0], model_config.seq_len
    rng = np.random.default_rng(trainer_config.seed)
    batches = [rng.integers(0, vocab_size, (batch_size, seq_len), dtype=np.int32) for _ in range(4)]

    check_fp8(model_config.fp8)
    state = trainer.initial_state(
        lambda key: model_config.for_training(model_config.build(vocab_size, key=key))
    )
    start = time.perf_counter()
    step_fn = trainer.compiled_step(state, batches[0])
    compile_s = time.perf_counter() - start
    batches = [trainer.runtime.shard_batch(b) for b in batches]

    def timed(state, n: int, save_every: int | None = None, first: int = 0):
        times = []
        for i in range(n):
            start = time.perf_counter()
            state, metrics = step_fn(state, batches[i % len(batches)])
            if save_every and (i + 1) % save_every == 0:
                trainer.checkpointer.save(first + i, state, {}, permanent=True)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        return state, metrics, times

    state, metrics, _ = timed(state, warmup)
    state, metrics, times = timed(state, steps)
    step_s = statistics.median(times)
    tokens_per_second = batch_size * seq_len / step_s
    flops_per_token = 3 * model_config.flops_per_token(vocab_size)
    peak_total = total_peak_flops(
        trainer_config.policy.compute_dtype, trainer_config.device_peak_flops
    )
    mfu = tokens_per_second * flops_per_token / peak_total if peak_total else None
    result = {
        "compile_s": round(compile_s, 3),
        "step_ms_median": round(step_s * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "tokens_per_second": round(tokens_per_second, 1),
        "flops_per_token": flops_per_token,
        "flops_per_token_full_attention": 3
        * model_config.flops_per_token(vocab_size, causal=False),
        "achieved_gflops": round(tokens_per_second * flops_per_token / 1e9, 2),
        "peak_gflops": round(peak_total / 1e9, 2) if peak_total else None,
        "mfu": round(mfu, 4) if mfu is not None else None,
        "params": model_config.param_count(vocab_size),
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "final_loss": float(metrics["train/loss"]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if jax.devices()[0].platform == "cpu":  # did the CPU flags take effect?
        hlo = step_fn.as_text()
        result["hlo_library_calls"] = library_calls(hlo)
        result["hlo_fingerprint"] = hlo_fingerprint(hlo)
    peak_bytes = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    if peak_bytes is not None:
        result["device_peak_gb"] = round(peak_bytes / 2**30, 2)
    if save_every:
        try:
            saves, state = _with_saves(trainer, timed, state, steps, save_every, times)
            result.update(saves)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if profile_dir:  # a trace that cannot be taken leaves the timings standing
        try:
            from loomax.hooks.profiler import start_trace

            start_trace(profile_dir)
            try:
                timed(state, PROFILE_STEPS)
            finally:
                jax.profiler.stop_trace()
            result["profile_dir"] = profile_dir
        except Exception as e:  # noqa: BLE001 - reported in the result instead
            result["profile_error"] = f"{type(e).__name__}: {e}"
    if jax.devices()[0].platform == "cpu" and trainer_config.device_peak_flops is None:
        result["matmul_probe_gflops"] = round(measure_matmul_flops("float32") / 1e9, 2)
    print(
        f"model {type(model_config).__name__}: {result['params'] / 1e6:.2f}M params, batch {batch_size} x {seq_len}"
    )
    print(f"compile:        {compile_s:8.2f} s")
    print(f"step (median):  {step_s * 1e3:8.1f} ms over {steps} steps")
    print(f"tokens/s:       {tokens_per_second:8.1f}")
    print(
        f"FLOPs/token:    {flops_per_token / 1e6:8.1f} M (train: 3 x forward, causal attention as half)"
    )
    print(f"achieved:       {result['achieved_gflops']:8.1f} GFLOP/s")
    if mfu is not None:
        print(f"MFU:            {mfu:8.1%} of {peak_total / 1e9:.1f} GFLOP/s peak")
    if save_every:
        print(
            f"with a checkpoint every {save_every} steps ({result['checkpoint_mb']:.1f} MB): mean step "
            f"{result['step_ms_mean_saving']:.1f} ms vs {result['step_ms_mean']:.1f} ms without "
            f"({result['checkpoint_overhead']:+.1%}); last save drained in {result['checkpoint_drain_s']:.2f} s"
        )
    shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(result))
    return result


def _with_saves(trainer, timed, state, steps: int, save_every: int, plain: list[float]):
    """Alternate blocks of ``steps`` steps with and without an async checkpoint every ``save_every``.

    Two blocks of each (the first plain block is ``plain``), so drift on a noisy machine
    hits both sides; the mean step times are compared. Returns the figures and the state.
    """
    plain, saving, drain = list(plain), [], 0.0
    for block in range(2):
        state, _, times = timed(state, steps, save_every, first=(block + 1) * 10**6)
        saving += times
        start = time.perf_counter()
        trainer.checkpointer.wait()
        drain = max(drain, time.perf_counter() - start)
        if block == 0:
            state, _, times = timed(state, steps)
            plain += times
    mean, mean_saving = statistics.mean(plain), statistics.mean(saving)
    figures = {
        "save_every": save_every,
        "checkpoint_mb": round(trainer.checkpointer.last_save_bytes / 1e6, 2),
        "step_ms_mean": round(mean * 1e3, 2),
        "step_ms_mean_saving": round(mean_saving * 1e3, 2),
        "checkpoint_overhead": round(mean_saving / mean - 1, 4),
        "checkpoint_drain_s": round(drain, 3),
    }
    return figures, state
