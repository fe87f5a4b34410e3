"""Worker for the sharding tests: train a tiny GPT-2 for 5 steps on given meshes, print JSON.

Run as a subprocess (the device count is fixed when JAX starts):
  python sharded_run.py suite '{"meshes": [[1,1,1,1], ...], ...}'  # one process, every case named:
      meshes: [[replica, data, model, devices], ...]     a GPT-2 on each mesh (the first from
          a fresh init, the others from the checkpoint ``start``)
      start: STEP_DIR                                    the GPT-2's step-0 checkpoint
      llama: [[kv_heads, replica, data, model, devices], ...]  a grouped-query Llama on meshes
      mixtral: [[replica, data, model, devices], ...]    a tiny Mixtral (MoE) on meshes
      context: STEP_DIR                                  a Llama, data 2 x context 4 over 8 devices,
          from the pair's step-0 checkpoint of it
      load: [CHECKPOINTS, [[replica, data, model, devices], ...]]  the checkpoint loaded on meshes
  python sharded_run.py process ID COUNT PORT RUN_DIR STEP   # one of COUNT processes of 4 devices:
      the GPT-2 on data=4 over the first 2 devices of each (RUN_DIR, its fresh state saved as
      step 0), the Llama of `context` (RUN_DIR-context, likewise), then the GPT-2 again from
      that step 0 with a SIGTERM to the last process after STEP (RUN_DIR-sigterm)

The pair's runs save a final checkpoint under their run dir. One process runs its cases in a
row (a start and the imports once, not once per case). A model's init is compiled once:
the GPT-2's runs on other meshes start from the pair's step-0 checkpoint (a load, read
straight into their layout, costs a fraction of compiling the init for every mesh), the
Llamas' and the Mixtral's from their first run's weights (``initial_weights``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from signal import SIGTERM

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from loomax.checkpoint import CheckpointerConfig  # noqa: E402
from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.distributed import DistributedConfig  # noqa: E402
from loomax.hooks import ActivationStatsHook  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import Gpt2Config, LlamaConfig, MixtralConfig, MoeConfig  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig, setup_process  # noqa: E402

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)
VOCAB, STEPS, BATCH = 64, 5, 8


def loader() -> BatchLoader:
    tokens = np.random.default_rng(0).integers(0, VOCAB, 40 * MODEL.seq_len, dtype=np.int32)
    return BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=0)


def make_trainer(
    mesh: MeshConfig,
    run_dir: str,
    devices=None,
    *,
    start: str | None = None,
    save_start: bool = False,
    **settings,
) -> Trainer:
    """A trainer of ``STEPS`` on ``mesh``; its state resumed from the step-0 checkpoint
    ``start`` (instead of a fresh init), or its fresh state saved as step 0 (``save_start``)."""
    processes = getattr(settings.get("distributed"), "num_processes", None)
    # the pair's runs save their last step (the tests read those checkpoints); the
    # one-process runs' checkpoints nobody reads
    saving = CheckpointerConfig(save_at_end=(processes or 1) > 1, save_at_start=save_start)
    settings.setdefault("checkpointer", saving)
    if start is not None:
        settings.update(load_checkpoint=True, load_checkpoint_path=start)
    config = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=BATCH,
        mesh=mesh,
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=run_dir,
        **settings,
    )
    optimizer = AdamConfig(learning_rate=3e-3, warmup=0)
    run_id = setup_process(config)
    if callable(devices):  # picked once the processes have joined
        devices = devices()
    return Trainer(config, optimizer.build(STEPS), lm_loss(), run_id=run_id, devices=devices)


def digest(state) -> dict:
    """Per leaf, the wrapping sum of its elements' bit patterns: exact, and independent of
    layout (one program for the whole state)."""
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}

    @jax.jit
    def bitsums(leaves):
        return [
            jax.lax.bitcast_convert_type(x, unsigned[x.dtype.itemsize])
            .astype(jnp.uint32)
            .sum(dtype=jnp.uint32)
            for x in leaves
        ]

    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(state)[0], strict=True)
    sums = bitsums(list(leaves))
    return {
        jax.tree_util.keystr(path): int(np.asarray(total.addressable_data(0)))
        for path, total in zip(paths, sums, strict=True)
    }


def _activations(info) -> dict[str, float]:
    return {k: v for k, v in info.host_metrics().items() if k.startswith("activations/")}


def step0(run_dir) -> str:
    """The step-0 checkpoint under ``run_dir`` (saved by ``make_trainer(save_start=True)``)."""
    return os.path.join(run_dir, "checkpoints", "step-0")


def run(
    mesh: MeshConfig,
    devices=None,
    distributed: DistributedConfig | None = None,
    run_dir=None,
    sigterm_at: int | None = None,
    start: str | None = None,
    save_start: bool = False,
) -> dict:
    trainer = make_trainer(
        mesh, run_dir or tempfile.mkdtemp(), devices, start=start, save_start=save_start,
        distributed=distributed or DistributedConfig(),
    )  # fmt: skip
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    activations: dict[str, float] = {}
    if distributed is None:  # the mesh runs: the last step's activation statistics, sharded
        # taken every step: one step program per mesh (the statistics' variant), not two
        trainer.add_hook(ActivationStatsHook(every=1))
        trainer.add_hook(lambda info: activations.update(_activations(info)), every=STEPS)
    if sigterm_at is not None and jax.process_index() == jax.process_count() - 1:
        trainer.add_hook(lambda info: info.step == sigterm_at and os.kill(os.getpid(), SIGTERM))
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    specs = {
        "embedding": str(state.model.token_embeddings.weight.array.sharding.spec),
        "mlp_up": str(state.model.blocks.stacked.mlp.up.weight.array.sharding.spec),
        "mlp_up_axes": [a.name for a in state.model.blocks.stacked.mlp.up.weight.axes],
        "adam_mu_mlp_up": str(
            state.opt_state[1].mu.blocks.stacked.mlp.up.weight.array.sharding.spec
        ),
    }
    shards = state.model.token_embeddings.weight.array.addressable_shards
    specs["embedding_shard_shape"] = list(shards[0].data.shape)
    final = trainer.train(state, loader().iter_from(0, *trainer.runtime.row_block))
    return {
        "losses": losses,
        "activations": activations,
        "specs": specs,
        "final_step": final.step,
        "mesh": dict(trainer.mesh.shape),
        "saved_bytes": trainer.checkpointer.last_save_bytes,
        "stop_reason": trainer.stop_reason,
        "digest": digest(final.state),
    }


def load(path: str, mesh: MeshConfig, devices) -> dict:
    trainer = make_trainer(
        mesh, tempfile.mkdtemp(), devices, load_checkpoint=True, load_checkpoint_path=path
    )
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    up = state.model.blocks.stacked.mlp.up.weight.array
    return {
        "step": int(state.step),
        "mesh": dict(trainer.mesh.shape),
        "mlp_up_spec": str(up.sharding.spec),
        "mlp_up_shard_shape": list(up.addressable_shards[0].data.shape),
        "digest": digest(state),
    }


WEIGHTS: dict[str, object] = {}
"""A model's first (fresh) run's weights, on the host, by model: its runs on other meshes
start from them."""


def first_or_same_weights(trainer: Trainer, name: str, build) -> object:
    """``trainer``'s state: the model ``name``'s first from a fresh init (compiled once), the
    others from that init's weights, placed by their mesh's mapping (``initial_weights``, the
    product's start from given weights: the optimizer state made anew, no init compiled)."""
    if name in WEIGHTS:
        return trainer.initial_state(build, initial_weights=lambda: WEIGHTS[name])
    state = trainer.initial_state(build)
    WEIGHTS[name] = jax.device_get(state.model)  # before training donates it
    return state


def run_llama(kv_heads: int, mesh: MeshConfig, devices) -> dict:
    """A few steps of a grouped-query Llama (4 query heads) under the default mappings,
    from a fresh init (the first with ``kv_heads``) or the first's weights."""
    model = LlamaConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=kv_heads,
    )  # fmt: skip
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("loomax").addHandler(handler)
    trainer = make_trainer(mesh, tempfile.mkdtemp(), devices)
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    build = lambda key: model.build(VOCAB, key=key)  # noqa: E731
    state = first_or_same_weights(trainer, f"llama{kv_heads}", build)
    k_proj = state.model.blocks.stacked.attn.k_proj.weight
    trainer.train(state, loader().iter_from(0, 0, 1))
    logging.getLogger("loomax").removeHandler(handler)
    return {
        "losses": losses,
        "k_proj_axes": [a.name for a in k_proj.axes],
        "k_proj_spec": str(k_proj.array.sharding.spec),
        "kept_whole": [w for w in warnings if "kept whole" in w],
    }


def run_mixtral(mesh: MeshConfig, devices) -> dict:
    """A few steps of a tiny Mixtral (4 experts, top 2) under the default mappings, from a
    fresh init (the first) or the first's weights."""
    model = MixtralConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=2, num_heads=4,
        num_kv_heads=2, moe=MoeConfig(num_experts=4, num_experts_per_tok=2),
    )  # fmt: skip
    trainer = make_trainer(mesh, tempfile.mkdtemp(), devices)
    losses: list[float] = []
    balance: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    trainer.add_hook(lambda info: balance.append(float(info.metrics["moe/load_balance_loss"])))
    build = lambda key: model.build(VOCAB, key=key)  # noqa: E731
    state = first_or_same_weights(trainer, "mixtral", build)
    trainer.train(state, loader().iter_from(0, 0, 1))
    return {"losses": losses, "load_balance": balance}


def run_context(
    distributed: DistributedConfig | None = None, run_dir=None, start: str | None = None
) -> dict:
    """5 steps and an eval of a tiny Llama, data 2 x context 4 over 8 devices interleaved
    across processes (a process's devices at every other place of each context group); the
    pair's from a fresh init (saved as step 0), one process's from that checkpoint ``start``."""
    from loomax.data.loader import process_rows
    from loomax.hooks.eval import make_loss_evaluator
    from loomax.mesh import context_spans_processes

    model = LlamaConfig(
        seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=2, cross_entropy_block_size=32,
        gradient_checkpointing=False,  # the ring's step compiles 20% faster without remat
    )  # fmt: skip

    def interleaved():
        return [jax.devices()[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]

    mesh = MeshConfig(data=2, context=4)
    trainer = make_trainer(
        mesh,
        run_dir or tempfile.mkdtemp(),
        interleaved,
        start=start,
        save_start=distributed is not None,
        distributed=distributed or DistributedConfig(),
    )
    rows = trainer.runtime.row_block
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    state = trainer.initial_state(lambda key: model.build(VOCAB, key=key))
    tokens = np.random.default_rng(0).integers(0, VOCAB, 40 * model.seq_len, dtype=np.int32)
    data = BatchLoader(TokenWindows(tokens, model.seq_len), BATCH, seed=0)
    final = trainer.train(state, data.iter_from(0, *rows))
    evals = [data.batch(STEPS + i) for i in range(2)]  # as eval_sets: the block's rows of each
    evaluate = make_loss_evaluator(
        lm_loss(), [b[process_rows(len(b), *rows)] for b in evals],
        trainer.config.policy, jit=trainer.runtime.jit, prepare=trainer.place_batch,
    )  # fmt: skip
    return {
        "losses": losses,
        "eval_loss": evaluate(final.state.model)["eval/loss"],
        "row_block": list(rows),
        "spans_processes": context_spans_processes(trainer.mesh.devices),
        "processes": [d.process_index for d in trainer.mesh.devices.flat],
        "mesh": dict(trainer.mesh.shape),
        "digest": digest(final.state),
    }


def two_per_process() -> list:
    """The first 2 devices of each process, in process order (4 devices of 2 processes)."""
    return [d for p in range(jax.process_count()) for d in jax.local_devices(p)[:2]]


def suite(cases: dict) -> dict:
    """Every case of ``cases`` (see the module's docstring), on this process's devices. A
    model's first run starts fresh; its runs on the other meshes start from the same
    weights: the GPT-2's from the step-0 checkpoint ``start``, the others' from their first
    run's weights (``first_or_same_weights``)."""
    out: dict = {}
    meshes = [(MeshConfig(r, d, m), jax.devices()[:n]) for r, d, m, n in cases.get("meshes", [])]
    start = cases.get("start")
    out["meshes"] = [
        run(mesh, devices=devices, start=start if i else None)
        for i, (mesh, devices) in enumerate(meshes)
    ]
    out["llama"] = [
        run_llama(kv_heads, MeshConfig(r, d, m), jax.devices()[:n])
        for kv_heads, r, d, m, n in cases.get("llama", [])
    ]
    out["mixtral"] = [
        run_mixtral(MeshConfig(r, d, m), jax.devices()[:n])
        for r, d, m, n in cases.get("mixtral", [])
    ]
    if cases.get("context"):
        out["context"] = run_context(start=cases["context"])
    if "load" in cases:
        path, load_meshes = cases["load"]
        out["load"] = [
            load(path, MeshConfig(r, d, m), jax.devices()[:n]) for r, d, m, n in load_meshes
        ]
    return out


def main() -> None:
    mode = sys.argv[1]
    if mode == "suite":
        print(json.dumps(suite(json.loads(sys.argv[2]))))
    elif mode == "process":
        pid, count, port = map(int, sys.argv[2:5])
        run_dir, sigterm_at = sys.argv[5], int(sys.argv[6])
        dist = DistributedConfig(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
        )
        where = {"process_index": jax.process_index, "process_count": jax.process_count}
        result = run(
            MeshConfig(1, -1, 1), two_per_process, distributed=dist, run_dir=run_dir,
            save_start=True,
        )  # fmt: skip
        result.update({k: f() for k, f in where.items()})
        result["context"] = {**run_context(dist, run_dir + "-context"), **{
            k: f() for k, f in where.items()}}  # fmt: skip
        result["sigterm"] = run(
            MeshConfig(1, -1, 1), two_per_process, distributed=dist,
            run_dir=run_dir + "-sigterm", sigterm_at=sigterm_at, start=step0(run_dir),
        )  # fmt: skip
        print(json.dumps(result))


if __name__ == "__main__":
    main()
