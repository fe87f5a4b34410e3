"""Worker for the DiLoCo tests: trainers on 8 CPU devices against a plain-JAX reference, print JSON.

Run as a subprocess (the device count is fixed when JAX starts):
  python diloco_run.py suite RUN_DIR                   # every single-process scenario below
  python diloco_run.py process ID COUNT PORT RUN_DIR START  # scenario "streaming" as one of
      COUNT processes, from the one process's step-0 checkpoint START (its init, not compiled
      again in each process; the checkpoint's bits are the init's)
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from sharded_run import MODEL, VOCAB, digest, loader  # noqa: E402

from loomax.checkpoint import CheckpointerConfig  # noqa: E402
from loomax.distributed import DistributedConfig  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig, setup_process  # noqa: E402
from loomax.train.collectives import collectives, crosses  # noqa: E402
from loomax.train.diloco import DiLoCoConfig  # noqa: E402
from loomax.train.fragments import nodes, plan_fragments  # noqa: E402

STREAMING = DiLoCoConfig(inner_steps=4, fragments=2)
"""Two fragments, synced after steps 2 (fragment 0), 4 (fragment 1) and 6 (fragment 0 again)."""
STEPS = 6


def inner() -> optax.GradientTransformation:
    """SGD with momentum: its state carries over periods, and unlike Adam it does not blow
    float rounding (a sharded sum's order) up into visible differences, so the trainer and the
    reference can be compared to 1e-5."""
    return optax.sgd(0.5, momentum=0.9)


def adam() -> optax.GradientTransformation:
    return AdamConfig(learning_rate=3e-3, warmup=0, lr_schedule="constant").build(STEPS)


def trainer(mesh, optimizer, run_dir, diloco=None, steps=STEPS, **settings) -> Trainer:
    config = TrainerConfig(
        num_train_steps=steps,
        train_batch_size=8,
        mesh=mesh,
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=str(run_dir),
        diloco=diloco,
        **settings,
    )
    run_id = setup_process(config)
    return Trainer(config, optimizer, lm_loss(), run_id=run_id)


def per_worker(value: jax.Array) -> dict[int, float]:
    """A per-worker metric's values on this process, by worker."""
    return {s.index[0].start or 0: float(s.data[0]) for s in value.addressable_shards}


WEIGHTS: list = []
"""The first run's fresh model, on the host: every later fresh run starts from these weights."""


def fresh_state(t: Trainer):
    """``t``'s state: resumed if it loads a checkpoint, else fresh: the process's first run
    from the random init (compiled once), the others from its weights through
    ``initial_weights`` (the product's start from given weights: the workers' copies and the
    optimizer states made anew from them, no init compiled per DiLoCo setting)."""
    build = lambda key: MODEL.build(VOCAB, key=key)  # noqa: E731
    if WEIGHTS:
        return t.initial_state(build, initial_weights=lambda: WEIGHTS[0])
    state = t.initial_state(build)
    if t.restored_from is None:
        WEIGHTS.append(jax.device_get(state.model))  # before training donates it
    return state


def train(t: Trainer, start: int = 0) -> dict:
    losses: list = []
    logged: list[float] = []  # what hooks and trackers read: the mean over this process's workers
    t.add_hook(lambda info: (losses.append(info.metrics["train/loss"]), logged.append(info.loss)))
    state = fresh_state(t)
    batches = loader().iter_from(int(state.step), jax.process_index(), jax.process_count())
    final = t.train(state, batches).state
    if t.config.diloco is None:
        losses = [float(v) for v in losses]
    else:
        losses = [per_worker(v) for v in losses]
        losses = [[step[w] for step in losses] for w in sorted(losses[0])]  # by worker
    return {"losses": losses, "logged": logged, "digest": digest(final), "final": final}


def cross_replica_bytes(t: Trainer, state, sync=None) -> dict:
    """The compiled step's collectives: total, and bytes of those that cross ``replica``."""
    batch = next(iter(loader().iter_from(0)))
    found = collectives(t.compiled_step(state, batch, sync=sync).as_text())
    cross = [c for c in found if crosses(c, t.mesh, "replica")]
    return {
        "collectives": len(found),
        "cross": sorted({c.op for c in cross}),
        "cross_bytes": sum(c.bytes for c in cross),
    }


def bf16_sums(t: Trainer, state, batch) -> int:
    """Sums in bfloat16 in the sync program as lowered (the CPU backend then widens them)."""
    lowered = t.trace_step(state, batch, sync=0).lower().as_text()
    return len(re.findall(r"stablehlo.reduce.* : \(tensor<[^>]*xbf16>", lowered))


def reference(config: DiLoCoConfig, workers: int, optimizer, steps: int = STEPS) -> dict:
    """DiLoCo written out in plain JAX on one device: per-worker losses and final weights."""
    build = jax.jit(lambda key: MODEL.build(VOCAB, key=key))  # one program, not op by op
    model = build(jax.random.split(jax.random.PRNGKey(0))[0])
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, treedef = jax.tree.flatten(params)
    layer_axis = [
        [a.name for a in n.axes].index("layers") if "layers" in [a.name for a in n.axes] else None
        for n in nodes(params)
    ]
    plan = plan_fragments(params, config.fragments)
    loss = lm_loss()

    @jax.jit
    def inner(p, opt_state, rows):
        def mean_loss(p):
            (total, weight), _ = loss(eqx.combine(p, static), rows)
            return total / weight

        value, grads = jax.value_and_grad(mean_loss)(p)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    lr, mu = config.outer_learning_rate, config.outer_momentum

    @functools.partial(jax.jit, static_argnums=3)
    def sync(shared, local, momentum, fragment: int):
        """The outer step of ``fragment``'s pieces: one program per fragment (traced once)."""
        shared, momentum, local = list(shared), list(momentum), [list(w) for w in local]
        for piece in plan[fragment]:
            i, axis = piece.leaf, layer_axis[piece.leaf]
            part = [slice(None)] * shared[i].ndim
            if piece.stop is not None:
                part[axis] = slice(piece.start, piece.stop)
            part = tuple(part)
            deltas = [shared[i][part] - local[w][i][part] for w in range(workers)]
            if config.bf16_pseudo_gradients:
                deltas = [d.astype(jnp.bfloat16) for d in deltas]
            delta = functools.reduce(jnp.add, deltas).astype(jnp.float32) / workers
            m = mu * momentum[i][part] + delta
            new = shared[i][part] - lr * (delta + mu * m if mu else delta)
            momentum[i] = momentum[i].at[part].set(m)
            shared[i] = shared[i].at[part].set(new)
            for w in range(workers):
                local[w][i] = local[w][i].at[part].set(new)
        return shared, local, momentum

    shared = list(flat)
    local = [list(flat) for _ in range(workers)]
    states = [optimizer.init(params) for _ in range(workers)]
    momentum = [np.zeros(x.shape, x.dtype) for x in flat]
    losses: list[list[float]] = [[] for _ in range(workers)]
    batches = loader().iter_from(0)
    for step in range(1, steps + 1):
        rows = np.split(next(batches), workers)
        for w in range(workers):
            p, states[w], value = inner(jax.tree.unflatten(treedef, local[w]), states[w], rows[w])
            local[w] = jax.tree.leaves(p)
            losses[w].append(float(value))
        fragment = config.synced_at(step)
        if fragment is not None:
            shared, local, momentum = sync(shared, local, momentum, fragment)
    return {"losses": losses, "shared": shared, "local": local}


def largest_difference(xs, ys) -> float:
    """In numpy: no program compiled per leaf shape."""
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(xs, ys, strict=True)
    )


def max_diff(final, ref) -> dict:
    """Largest difference of the trainer's shared model and workers from the reference's."""
    shared = jax.tree.leaves(eqx.filter(final.model, eqx.is_inexact_array))
    workers = jax.tree.leaves(final.opt_state.workers)
    return {
        "shared": largest_difference(shared, ref["shared"]),
        "workers": max(
            largest_difference([np.asarray(a)[w] for a in workers], local)
            for w, local in enumerate(ref["local"])
        ),
        "moved": largest_difference(ref["shared"], ref["local"][0]),
    }


def suite(run_dir: Path) -> dict:
    out: dict = {}
    # 1. streaming, 2 workers: against the reference; the programs' collectives; resume
    t = trainer(MeshConfig(2, -1, 1), inner(), run_dir / "a", STREAMING,
                checkpointer=CheckpointerConfig(fixed_steps=[3], save_at_start=True))  # fmt: skip
    run = train(t)
    ref = reference(STREAMING, 2, inner())
    out["streaming"] = {
        "losses": run["losses"], "ref_losses": ref["losses"], "digest": run["digest"],
        "diff": max_diff(run["final"], ref),
        "inner": cross_replica_bytes(t, run["final"]),
        "sync": cross_replica_bytes(t, run["final"], sync=0),
        "start": str(run_dir / "a" / "checkpoints" / "step-0"),  # the processes start there
    }  # fmt: skip
    resumed = trainer(MeshConfig(2, -1, 1), inner(), run_dir / "b", STREAMING,
                      load_checkpoint_path=str(run_dir / "a" / "checkpoints" / "step-3"))  # fmt: skip
    out["streaming"]["resumed_digest"] = train(resumed)["digest"]
    batch = t.runtime.shard_batch(next(iter(loader().iter_from(0))))
    out["streaming"]["bf16_sums"] = bf16_sums(t, run["final"], batch)

    # 2. four workers, Adam inside, bf16 pseudo-gradients: against the reference
    bf16 = DiLoCoConfig(inner_steps=2, bf16_pseudo_gradients=True)
    t = trainer(MeshConfig(4, -1, 1), adam(), run_dir / "c", bf16, steps=4)
    run = train(t)
    ref = reference(bf16, 4, adam(), steps=4)
    batch = t.runtime.shard_batch(next(iter(loader().iter_from(0))))
    out["four"] = {"losses": run["losses"], "ref_losses": ref["losses"],
                   "diff": max_diff(run["final"], ref),
                   "bf16_sums": bf16_sums(t, run["final"], batch)}  # fmt: skip

    # 3. H=1, outer SGD at lr 1: data-parallel SGD
    local_sgd = DiLoCoConfig(inner_steps=1, outer_learning_rate=1.0, outer_momentum=0.0)
    dl = train(trainer(MeshConfig(2, -1, 1), optax.sgd(0.5), run_dir / "d", local_sgd, steps=3))
    dp_trainer = trainer(MeshConfig(2, -1, 1), optax.sgd(0.5), run_dir / "e", steps=3)
    dp = train(dp_trainer)
    diff = largest_difference(
        jax.tree.leaves(dl["final"].model), jax.tree.leaves(dp["final"].model)
    )
    out["dp"] = {
        "diloco_losses": dl["logged"], "worker_mean": np.mean(dl["losses"], axis=0).tolist(), "dp_losses": dp["losses"],
        "diff": diff, "dp_step": cross_replica_bytes(dp_trainer, dp["final"]),
    }  # fmt: skip
    return out


def main() -> None:
    mode = sys.argv[1]
    if mode == "suite":
        print(json.dumps(suite(Path(sys.argv[2]))))
    elif mode == "process":
        pid, count, port = map(int, sys.argv[2:5])
        dist = DistributedConfig(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
        )
        t = trainer(MeshConfig(2, -1, 1), inner(), sys.argv[5], STREAMING, distributed=dist,
                    checkpointer=CheckpointerConfig(save_at_end=False),
                    load_checkpoint=True, load_checkpoint_path=sys.argv[6])  # fmt: skip
        run = train(t)
        print(json.dumps({"losses": run["losses"], "logged": run["logged"], "digest": run["digest"],
                          "process_index": jax.process_index()}))  # fmt: skip


if __name__ == "__main__":
    main()
