"""Worker for the pipeline tests: a tiny Llama (8 layers) trained 5 steps on 1 device (the
one reference every schedule is compared with) and on 8 CPU devices as stage 4 x data 2
under each executed schedule (each step compiled once, ahead of time: its loop's trip
counts read off that program); then a checkpoint written at step 1 by the stage-4 GPipe run
resumed on 4 devices as stage 2 x data 2 for steps 2 to 5; the stack's FLOPs; a tiny
mixture of experts on 1 device and on stage 2 x expert 2 x data 2 under GPipe, 1F1B,
interleaved 1F1B and zero-bubble; a 4-layer stack's activation statistics and per-head
maximum logits on 1 device and on stage 2 x data 2 under GPipe, and 1F1B's refusal of
them (stage 4 x data 2); prints JSON. (The temporaries of GPipe against 1F1B, four more compiles, are
``bench/pipeline_memory.py``'s.)

  python pipeline_run.py [SCHEDULE ...] [resume] [flops] [moe_SCHEDULE ...] [gpt2] [mla]
                         [moe_balance] [stats] [stats_interleaved]
  (resume needs gpipe; without arguments: what test_pipeline.py checks, the mixture of
  experts under every schedule but interleaved; gpt2, mla: those under 1F1B; moe_balance:
  every MoE schedule at moe_tiny's load-balance weight, and 1 device accumulating 4
  microbatches; stats: a 4-layer stack's activation statistics and QK-clip maxima on 1
  device and stage 2 x data 2 under GPipe, stats_interleaved also interleaved)
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.checkpoint import CheckpointerConfig  # noqa: E402
from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.stages import PipelineConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402

MODEL = LlamaConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=8, num_heads=4, num_kv_heads=2
)  # fmt: skip
VOCAB, STEPS, BATCH, SAVED_AT = 64, 5, 16, 1  # 4 steps after the save: its Adam state counts
RUNS = {
    "gpipe": (MeshConfig(data=2, stage=4), PipelineConfig(microbatches=8)),
    "interleaved": (
        MeshConfig(data=2, stage=4),
        PipelineConfig(schedule="interleaved", microbatches=8, virtual_stages=2),
    ),
    "1f1b": (MeshConfig(data=2, stage=4), PipelineConfig(schedule="1f1b", microbatches=8)),
    "interleaved_1f1b": (
        MeshConfig(data=2, stage=4),
        PipelineConfig(schedule="interleaved_1f1b", microbatches=8, virtual_stages=2),
    ),
    "zero_bubble": (
        MeshConfig(data=2, stage=4),
        PipelineConfig(schedule="zero_bubble", microbatches=8),
    ),
}


def loader() -> BatchLoader:
    tokens = np.random.default_rng(0).integers(0, VOCAB, 40 * MODEL.seq_len, dtype=np.int32)
    return BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=0)


def make_trainer(
    mesh: MeshConfig, pipeline: PipelineConfig, devices, run_dir: str, **settings
) -> Trainer:
    config = TrainerConfig(
        num_train_steps=STEPS, train_batch_size=BATCH, mesh=mesh, pipeline=pipeline,
        progress_bar=False, tracker=NoopTrackerConfig(), run_dir=run_dir, **settings,
    )  # fmt: skip
    optimizer = AdamConfig(learning_rate=3e-3, warmup=0)
    return Trainer(config, optimizer.build(STEPS), lm_loss(), devices=devices)


def train(mesh: MeshConfig, pipeline: PipelineConfig, devices, run_dir: str | None = None) -> dict:
    """``STEPS`` steps; the stage-4 GPipe run (given ``run_dir``) also saves step ``SAVED_AT``."""
    saving = CheckpointerConfig(fixed_steps=[SAVED_AT], save_at_end=False, async_save=False)
    settings = {"checkpointer": saving} if run_dir else {}
    trainer = make_trainer(mesh, pipeline, devices, run_dir or tempfile.mkdtemp(), **settings)
    losses: list[float] = []
    norms: list[float] = []  # Adam hides a gradient's scale from the losses; its norm does not
    trainer.add_hook(lambda info: losses.append(info.loss))
    trainer.add_hook(lambda info: norms.append(float(info.metrics["optim/grad_norm"])))
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    up = state.model.blocks.stacked.mlp.up_proj.weight.array
    spec, shape = str(up.sharding.spec), list(up.addressable_shards[0].data.shape)
    batch = trainer.place_batch(next(iter(loader().iter_from(0))))
    compiled = trainer.precompile(state, batch)  # the program the steps then run
    trips = sorted({int(n) for n in re.findall(r"known_trip_count\D*(\d+)", compiled.as_text())})
    trainer.train(state, loader().iter_from(0, *trainer.runtime.row_block))
    return {
        "losses": losses,
        "grad_norms": norms,
        "mlp_up_spec": spec,
        "mlp_up_shard_shape": shape,
        "loop_trip_counts": trips,
    }


def stack_flops() -> dict:
    """Matmul FLOPs of the layer stack's gradient (``loomax plan``'s count over the traced
    program, all devices), unstaged, under GPipe and interleaved (without a loss tail in
    context the other schedules run GPipe's forward loop too)."""
    import equinox as eqx
    import haliax as hax

    from loomax.models.layers import run_layers
    from loomax.plan.flops import count_step
    from loomax.runtime import MeshRuntime

    # shapes only (the count reads the traced program): no eager op compiled to build them
    blocks = eqx.filter_eval_shape(MODEL.build, VOCAB, key=jax.random.PRNGKey(0)).blocks
    axes = (hax.Axis("batch", BATCH), hax.Axis("position", MODEL.seq_len), MODEL.Embed)
    x = eqx.filter_eval_shape(hax.random.normal, jax.random.PRNGKey(1), axes)
    grad = eqx.filter_grad(lambda b, x: hax.sum(run_layers(b, x, None)).array)
    out = {}
    runs = {"single": (MeshConfig(data=1), None), **{k: RUNS[k] for k in ("gpipe", "interleaved")}}
    for name, (mesh, pipeline) in runs.items():
        devices = jax.devices()[:1] if name == "single" else None
        mappings = TrainerConfig(mesh=mesh).axis_mappings()
        runtime = MeshRuntime.create(mesh, mappings, devices, pipeline)
        with runtime.mesh_context():
            out[name] = count_step(jax.make_jaxpr(grad)(blocks, x)).dot_flops
    return out


MOE_SCHEDULES = {  # stage 2 x expert 2 x data 2, 4 microbatches
    "gpipe": PipelineConfig(microbatches=4),
    "1f1b": PipelineConfig(schedule="1f1b", microbatches=4),
    "interleaved_1f1b": PipelineConfig(
        schedule="interleaved_1f1b", microbatches=4, virtual_stages=2
    ),
    "zero_bubble": PipelineConfig(schedule="zero_bubble", microbatches=4),
}


def moe_config(balance: float = 0.0, matmul: str = "ragged_dot"):
    """A tiny mixture of experts: moe_tiny's routing (16 experts, top 4, z-loss 1e-3 and the
    aux-loss-free bias at rate 1e-3), 4 layers of width 32 (2 chunks of 1 layer on each of 2
    stages for interleaved 1F1B); ``balance``: the load-balance loss's weight (moe_tiny's is
    1e-3; a product of batch shares, per microbatch staged). The experts' grouped matmul is
    ``jax.lax.ragged_dot``: CPU's default (``blocked``, equal to it in
    tests/models/moe/test_grouped_matmul.py) loops over row tiles, ~80 more while loops in a
    zero-bubble step (each chunk's forward and vjp in 6 branches), whose compile took 17 s
    instead of 11.6 s (``time.process_time``, AMD EPYC, loaded); the schedules do not see
    the difference."""
    from loomax.models import MixtralConfig, MoeConfig

    return MixtralConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=4, num_heads=4,
        num_kv_heads=2, moe=MoeConfig(
            num_experts=16, num_experts_per_tok=4, expert_intermediate_dim=16,
            load_balance_loss_weight=balance, router_z_loss_weight=1e-3, bias_update_rate=1e-3,
            matmul=matmul,
        ),
    )  # fmt: skip


def fit(config, runs) -> dict:
    """``config``'s model trained ``STEPS`` steps for each ``(name, mesh, pipeline, devices,
    settings)`` of ``runs``: ``{name: {losses, grad_norms}}``."""
    out = {}
    for name, mesh, pipeline, devices, settings in runs:
        trainer = make_trainer(mesh, pipeline, devices, tempfile.mkdtemp(), **settings)
        losses: list[float] = []
        norms: list[float] = []
        trainer.add_hook(lambda info, losses=losses: losses.append(info.loss))
        trainer.add_hook(
            lambda info, norms=norms: norms.append(float(info.metrics["optim/grad_norm"]))
        )
        state = trainer.initial_state(lambda key: config.build(VOCAB, key=key))
        trainer.train(state, loader().iter_from(0, *trainer.runtime.row_block))
        out[name] = {"losses": losses, "grad_norms": norms}
    return out


def moe(schedules, balance: float = 0.0) -> dict:
    """``moe_config(balance)`` trained on 1 device (one reference) and on stage 2 x expert 2
    x data 2 under each of ``schedules``; with a ``balance`` also on 1 device accumulating 4
    microbatches (the pipeline's rows), and the ``blocked`` grouped matmul (what docs/pipeline.md's
    figures for it were measured with)."""
    one = jax.devices()[:1]
    runs = [("single", MeshConfig(data=1), PipelineConfig(), one, {})]
    if balance:
        accumulate = {"per_device_parallelism": BATCH // 4}
        runs += [("single_accumulated_4", MeshConfig(data=1), PipelineConfig(), one, accumulate)]
    mesh = MeshConfig(data=2, expert=2, stage=2)
    runs += [(name, mesh, MOE_SCHEDULES[name], None, {}) for name in schedules]
    return fit(moe_config(balance, "blocked" if balance else "ragged_dot"), runs)


def gpt2() -> dict:
    """A tiny GPT-2 (2 layers of width 32, tied head; its final LayerNorm is the loss's tail)
    on 1 device and on stage 2 x data 4 under 1F1B, 4 microbatches."""
    from loomax.models import Gpt2Config

    config = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)
    return fit(config, [
        ("single", MeshConfig(data=1), PipelineConfig(), jax.devices()[:1], {}),
        ("1f1b", MeshConfig(data=4, stage=2), MOE_SCHEDULES["1f1b"], None, {}),
    ])  # fmt: skip


def mla() -> dict:
    """A tiny DeepSeek-V3 (multi-head latent attention, sigmoid group-limited routing with
    the bias and a shared expert; 2 layers of width 32, no dense first layers nor MTP) on 1
    device and on stage 2 x expert 2 x data 2 under 1F1B, 4 microbatches."""
    from loomax.models import MoeConfig
    from loomax.models.attention.rotary import DefaultRotary
    from loomax.models.families.deepseek_v3 import DeepseekV3Config

    config = DeepseekV3Config(
        seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=2, num_heads=4,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        rope=DefaultRotary(theta=10000.0), moe=MoeConfig(
            num_experts=8, num_experts_per_tok=2, expert_intermediate_dim=16,
            score_function="sigmoid", num_shared_experts=1, num_groups=2, topk_groups=1,
            routing_bias=True, bias_update_rate=1e-3, first_dense_layers=0,
            load_balance_loss_weight=0.0, router_z_loss_weight=1e-3,
        ),
    )  # fmt: skip
    mesh = MeshConfig(data=2, expert=2, stage=2)
    return fit(config, [
        ("single", MeshConfig(data=1), PipelineConfig(), jax.devices()[:1], {}),
        ("1f1b", mesh, MOE_SCHEDULES["1f1b"], None, {}),
    ])  # fmt: skip


def stack_stats(schedules=("gpipe",)) -> dict:
    """A 4-layer ``MODEL`` stack's activation statistics and per-head maximum logits
    (QK-clip's), taken in a forward pass (a batch of 8 rows), on 1 device and
    on stage 2 x data 2 under each of ``schedules`` (``gpipe``, ``interleaved``: 2 chunks a
    stage; 4 microbatches): ``{run: {key: values}}``."""
    import dataclasses

    import equinox as eqx
    import haliax as hax

    from loomax.models.attention import max_logits
    from loomax.models.blocks import taps
    from loomax.models.layers import run_layers
    from loomax.runtime import MeshRuntime

    config = dataclasses.replace(MODEL, num_layers=4)
    build = eqx.filter_jit(lambda key: config.build(VOCAB, key=key).blocks)  # one compile,
    blocks = build(jax.random.PRNGKey(0))  # not one per eager op of the build
    axes = (hax.Axis("batch", 8), hax.Axis("position", config.seq_len), config.Embed)
    x = hax.random.normal(jax.random.PRNGKey(1), axes)

    staged = {
        "gpipe": PipelineConfig(microbatches=4),
        "interleaved": PipelineConfig(schedule="interleaved", microbatches=4, virtual_stages=2),
    }
    runs = {"single": (MeshConfig(data=1), PipelineConfig(), jax.devices()[:1])}
    runs |= {k: (MeshConfig(data=2, stage=2), staged[k], jax.devices()[:4]) for k in schedules}
    out = {}
    for name, (mesh, pipeline, devices) in runs.items():
        mappings = TrainerConfig(mesh=mesh).axis_mappings()
        runtime = MeshRuntime.create(mesh, mappings, devices, pipeline)

        def loss(b, x):  # a function per run: each traces under its own mesh and schedule
            with taps.collect() as recorded, max_logits.collecting() as seen:
                total = hax.sum(run_layers(b, x, None) ** 2).array
            return total, (taps.flatten(recorded), {k: v.array for k, v in seen.items()})

        with runtime.mesh_context():  # the forward pass only: a gradient triples the compile
            _, (acts, peaks) = eqx.filter_jit(loss)(blocks, x)
        out[name] = {k: np.asarray(v).tolist() for k, v in {**acts, **peaks}.items()}
    return out


def stats_under_1f1b() -> str:
    """What training under 1F1B (``RUNS``' stage 4 x data 2: its state's init is the one the
    1F1B run compiled, read back from the compilation cache) with activation statistics due
    at step 0 raises (a ``ConfigError``'s message), before any step runs."""
    from loomax.config import ConfigError
    from loomax.hooks import ActivationStatsHook

    trainer = make_trainer(*RUNS["1f1b"], None, tempfile.mkdtemp())
    trainer.add_hook(ActivationStatsHook(every=1))
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    try:
        trainer.train(state, loader().iter_from(0, *trainer.runtime.row_block))
    except ConfigError as error:
        return str(error)
    return "trained"


def resume(run_dir: str) -> dict:
    """The stage-4 GPipe run's checkpoint of step ``SAVED_AT`` (in ``run_dir``) resumed at
    stage 2 x data 2 (4 devices, GPipe) for the steps after it."""
    again = make_trainer(
        MeshConfig(data=2, stage=2), PipelineConfig(microbatches=8), jax.devices()[:4],
        tempfile.mkdtemp(), load_checkpoint=True, load_checkpoint_path=f"{run_dir}/checkpoints",
    )  # fmt: skip
    resumed: list[float] = []
    norms: list[float] = []  # of the gradients the update takes: steps 3-5 follow updates
    again.add_hook(lambda info: resumed.append(info.loss))
    again.add_hook(lambda info: norms.append(float(info.metrics["optim/grad_norm"])))
    state = again.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    start = int(state.step)
    up = state.model.blocks.stacked.mlp.up_proj.weight.array
    shape = list(up.addressable_shards[0].data.shape)
    again.train(state, loader().iter_from(start, *again.runtime.row_block))
    return {"start": start, "losses": resumed, "grad_norms": norms, "mlp_up_shard_shape": shape}


if __name__ == "__main__":
    out = {"single": train(MeshConfig(data=1), PipelineConfig(), jax.devices()[:1])}
    saved = tempfile.mkdtemp()
    for name, (mesh, pipeline) in RUNS.items():
        if len(sys.argv) < 2 or name in sys.argv[1:]:
            out[name] = train(mesh, pipeline, None, saved if name == "gpipe" else None)
    if len(sys.argv) < 2 or "resume" in sys.argv[1:]:
        out["resume"] = resume(saved)
    if len(sys.argv) < 2 or "flops" in sys.argv[1:]:
        out["stack_flops"] = stack_flops()
    moe_runs = [k for k in MOE_SCHEDULES if len(sys.argv) < 2 or f"moe_{k}" in sys.argv[1:]]
    if moe_runs:
        out["moe"] = moe(moe_runs)
    if "gpt2" in sys.argv[1:]:
        out["gpt2"] = gpt2()
    if "mla" in sys.argv[1:]:
        out["mla"] = mla()
    if len(sys.argv) < 2 or "stats" in sys.argv[1:]:
        out["stack_stats"] = stack_stats()
        out["stats_1f1b"] = stats_under_1f1b()
    if "stats_interleaved" in sys.argv[1:]:
        out["stack_stats"] = stack_stats(("gpipe", "interleaved"))
    if "moe_balance" in sys.argv[1:]:
        out["moe_balance"] = moe(list(MOE_SCHEDULES), 1e-3)
    print(json.dumps(out))
