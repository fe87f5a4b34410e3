"""Throughput of Levanter's own train step on a tiny GPT-2, for comparison with Loomax.

Run with the interpreter of the Levanter virtualenv (see bench/compare_levanter.py, which creates it):

    .venv-levanter/bin/python bench/levanter_gpt2_tiny.py --steps 10

Setup (kept identical to config/bench/gpt2_tiny.yaml on the Loomax side):
GPT-2, hidden 256, 4 layers, 4 heads, seq_len 256, vocab 50257, batch 8, fp32 params and compute,
gradient checkpointing on, AdamW (lr 1e-3, weight decay 0.1, no warmup), synthetic random token ids,
one CPU device.

The step that is timed is ``Trainer.train_step`` -- the per-step method that ``Trainer.train`` calls
through ``Trainer.training_steps`` -- which runs the trainer's named_jit-compiled ``_train_step``
(value_and_grad of the wrapped loss, optimizer update via ``TrainerState.take_step``) and then pulls
the loss back to the host. The loss is ``compute_next_token_loss`` exactly as ``levanter.main.train_lm``
builds it, and the optimizer is built by ``AdamConfig.build`` as in ``train_lm``.

Output: human-readable lines, then one JSON line as the last line of stdout:
    {"impl": "levanter", "compile_s": ..., "step_ms_median": ..., "tokens_per_second": ...,
     "flops_per_token": ..., ...}
"""

from __future__ import annotations

import argparse
import os

# Must be settled before jax is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

VOCAB_SIZE = 50257  # GPT-2 tokenizer size; given explicitly instead of loading a tokenizer


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=10, help="timed steady-state steps (default 10)")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps after the first one (default 3)"
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=VOCAB_SIZE)
    p.add_argument(
        "--no-grad-checkpointing",
        action="store_true",
        help="turn Levanter's gradient checkpointing off (default: on, Levanter's default)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import haliax as hax
    import jax
    import jax.random as jrandom
    import jmp
    import levanter
    import numpy as np
    from levanter.checkpoint import CheckpointerConfig
    from levanter.distributed import RayConfig
    from levanter.models.gpt2 import Gpt2Config
    from levanter.models.lm_model import LmExample, compute_next_token_loss
    from levanter.optim import AdamConfig
    from levanter.tracker import NoopConfig
    from levanter.trainer import Trainer, TrainerConfig
    from levanter.utils.jax_utils import parameter_count

    n_steps_total = 1 + args.warmup + args.steps
    workdir = Path(tempfile.mkdtemp(prefix="levanter_bench_"))

    model_config = Gpt2Config(
        seq_len=args.seq_len,
        hidden_dim=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        gradient_checkpointing=not args.no_grad_checkpointing,
    )
    trainer_config = TrainerConfig(
        seed=args.seed,
        id="levanter-bench",
        train_batch_size=args.batch_size,
        num_train_steps=n_steps_total,
        mp=jmp.get_policy("f32"),  # fp32 params and compute
        tracker=NoopConfig(),
        require_accelerator=False,
        log_dir=workdir / "logs",
        # These two write the jaxpr / StableHLO of the step on its first call; they would add
        # tracing and I/O to the first step but not change the compiled program.
        log_jaxprs=False,
        log_xla_hlo=False,
        checkpointer=CheckpointerConfig(base_path=str(workdir / "checkpoints")),
        load_checkpoint=False,
        ray=RayConfig(auto_start_cluster=False),
    )
    optimizer_config = AdamConfig(learning_rate=1e-3, weight_decay=0.1, warmup=0)

    # Same initialisation as levanter.main.train_lm: jax config flags, logging, run id, tracker.
    levanter.initialize(trainer_config)

    optimizer = optimizer_config.build(trainer_config.num_train_steps)
    # train_lm passes logsumexp_weight=config.z_loss_weight, whose default is 0.0.
    loss_fn = functools.partial(compute_next_token_loss, logsumexp_weight=0.0)

    devices = jax.devices()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {devices}")
    print(
        "versions: "
        + ", ".join(
            f"{d} {_version(d)}"
            for d in ("levanter", "haliax", "equinox", "jax", "jaxlib", "optax")
        )
    )
    xla_flags = os.environ.get("XLA_FLAGS")
    print(f"XLA_FLAGS={xla_flags!r}")

    # add_default_hooks=False: no progress bar, no checkpointer and, importantly, no WatchCallback.
    # The watch callback is a jit hook that makes every 10th step run (and compile) a second variant
    # of the step with grad/param norms; the other steps use the hook-free variant timed here.
    with Trainer(trainer_config, optimizer, loss_fn, add_default_hooks=False) as trainer:
        data_key, model_key, training_key = jrandom.split(jrandom.PRNGKey(args.seed), 3)
        del data_key

        Vocab = hax.Axis("vocab", args.vocab)
        Pos = model_config.Pos
        Batch = trainer.TrainBatch

        t0 = time.perf_counter()
        state = trainer.initial_state(
            training_key, model_init=lambda: model_config.build(Vocab, key=model_key)
        )
        state = jax.block_until_ready(state)
        init_s = time.perf_counter() - t0
        n_params = parameter_count(state.model)
        print(
            f"model: GPT-2 {model_config.num_layers}L h{model_config.hidden_dim} {model_config.num_heads}heads "
            f"seq {Pos.size} vocab {Vocab.size}; grad checkpointing {model_config.gradient_checkpointing}"
        )
        print(f"parameters: {n_params:,}; state init {init_s:.2f}s")

        # Synthetic batches of random ids, built like the training data loader builds them: one
        # causal LmExample per row, batched along the trainer's batch axis, placed with the compute
        # axis mapping. A few distinct batches are cycled so no step sees the same input twice in a row.
        rng = np.random.default_rng(args.seed)
        make_batch = hax.named_jit(
            hax.vmap(LmExample.causal, Batch), axis_resources=trainer.compute_axis_mapping
        )
        batches = []
        for _ in range(4):
            ids = rng.integers(0, Vocab.size, size=(Batch.size, Pos.size), dtype=np.int32)
            batches.append(jax.block_until_ready(make_batch(hax.named(ids, (Batch, Pos)))))

        def one_step(state, i):
            t = time.perf_counter()
            info = trainer.train_step(state, batches[i % len(batches)])
            jax.block_until_ready(info.state)
            return info, time.perf_counter() - t

        info, first_s = one_step(state, 0)
        state = info.state
        print(f"step 1 (trace + compile + run): {first_s:.2f}s  loss {info.loss:.4f}")

        for i in range(args.warmup):
            info, dt = one_step(state, 1 + i)
            state = info.state
            print(f"warmup step {info.step}: {dt * 1e3:.1f} ms  loss {info.loss:.4f}")

        times = []
        levanter_times = []  # Levanter's own step_duration (measured inside train_step)
        for i in range(args.steps):
            info, dt = one_step(state, 1 + args.warmup + i)
            state = info.state
            times.append(dt)
            levanter_times.append(float(info.step_duration))
            print(f"step {info.step}: {dt * 1e3:.1f} ms  loss {info.loss:.4f}")
        final_loss = float(info.loss)

    tokens_per_step = Batch.size * Pos.size
    med = statistics.median(times)
    fwd_flops_per_token = model_config.flops_per_token(Vocab.size)
    flops_per_token = 3 * fwd_flops_per_token if fwd_flops_per_token is not None else None
    tokens_per_second = tokens_per_step / med

    print()
    print(
        f"steady state over {len(times)} steps: median {med * 1e3:.1f} ms "
        f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}); "
        f"Levanter's own step_duration median {statistics.median(levanter_times) * 1e3:.1f} ms"
    )
    print(f"throughput: {tokens_per_second:,.0f} tokens/s ({tokens_per_step} tokens/step)")
    if flops_per_token is not None:
        print(
            f"model FLOPs (Levanter estimate x3): {flops_per_token / 1e6:.1f} MFLOP/token, "
            f"{flops_per_token * tokens_per_second / 1e9:.1f} GFLOP/s achieved"
        )
    print(f"first step (compile) {first_s:.2f}s; final loss {final_loss:.4f}")

    result = {
        "impl": "levanter",
        "compile_s": round(first_s, 4),
        "step_ms_median": round(med * 1e3, 3),
        "tokens_per_second": round(tokens_per_second, 2),
        "flops_per_token": flops_per_token,
        "step_ms_min": round(min(times) * 1e3, 3),
        "step_ms_max": round(max(times) * 1e3, 3),
        "steps": len(times),
        "warmup": args.warmup,
        "batch_size": Batch.size,
        "seq_len": Pos.size,
        "params": int(n_params),
        "final_loss": round(final_loss, 5),
        "levanter": _version("levanter"),
        "jax": _version("jax"),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
