"""Worker for the expert-parallel tests (8 CPU devices, fixed when JAX starts): prints JSON.

  python expert_parallel_run.py    # the MoE layer on meshes vs one device (output, gradients),
                                   # then 5 Mixtral steps on expert 4 x data 2 vs one device

The layer runs both forms of the token exchange: ``padded`` (all_to_all, what XLA:CPU runs)
and ``ragged``, whose ``jax.lax.ragged_all_to_all`` XLA:CPU cannot run ("HLO opcode
ragged-all-to-all is not supported"): here it is replaced by ``emulated_ragged_all_to_all``,
the primitive's documented semantics built from all_gather, so that the offsets and sizes
the ragged form computes are checked on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from haliax import Axis  # noqa: E402

from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models import MixtralConfig, MoeConfig  # noqa: E402
from loomax.models.moe import expert_parallel  # noqa: E402
from loomax.models.moe.expert_parallel import FORMS  # noqa: E402
from loomax.models.moe.moe import MoeMlp  # noqa: E402
from loomax.models.moe.moe_routing import RouterAux  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402

MESHES = {  # name: (replica, data, model, expert)
    "expert4_data2": MeshConfig(1, 2, 1, expert=4),
    "expert2_data2_model2": MeshConfig(1, 2, 2, expert=2),
    "expert8": MeshConfig(1, 1, 1, expert=8),  # one expert a device, as Mixtral at expert 8
}
EMBED = Axis("embed", 16)
X = hax.random.normal(jax.random.PRNGKey(1), (Axis("batch", 8), Axis("position", 6), EMBED))
COTANGENT = jax.random.normal(jax.random.PRNGKey(2), X.array.shape)


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``jax.lax.ragged_all_to_all`` from all_gather: sender i's rows
    ``operand[input_offsets[j] : + send_sizes[j]]`` land in receiver j's ``output`` at
    ``output_offsets[j]``; NaN everywhere if ``recv_sizes`` disagrees with what arrives."""
    me = jax.lax.axis_index(axis_name)
    rows, starts, sizes, dests = (
        jax.lax.all_gather(a, axis_name)
        for a in (operand, input_offsets, send_sizes, output_offsets)
    )
    slot = jnp.arange(output.shape[0])
    result = output
    for i in range(rows.shape[0]):
        inside = (slot >= dests[i, me]) & (slot < dests[i, me] + sizes[i, me])
        source = jnp.clip(starts[i, me] + slot - dests[i, me], 0, rows.shape[1] - 1)
        result = jnp.where(inside[:, None], rows[i][source], result)
    agree = jnp.all(recv_sizes == sizes[:, me])
    return jnp.where(agree, result, jnp.nan)


def layer(**moe) -> MoeMlp:
    config = MoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "matmul_block": 4, **moe})
    return MoeMlp.init(config, EMBED, 24, "silu", 1.0, key=jax.random.PRNGKey(0))


def objective(mlp, x):
    out, aux = mlp(x, RouterAux.zeros(1, mlp.moe.num_experts), 0)
    return jnp.sum(out.array * COTANGENT) + aux.balance[0], (out.array, aux.dropped[0])


LAYER_CASES = [  # (mesh, capacity_factor, form, k, matmul); k=3 > 2 experts per device: the
    # per-sender slot is T x 2 rows, not T x k (one token reaches 2 experts of one device at most)
    ("expert4_data2", None, "padded", 3, "auto"),
    ("expert2_data2_model2", 0.5, "padded", 2, "auto"),
    ("expert4_data2", 0.5, "ragged", 3, "auto"),
    # the TPU's path: rows land grouped, megablox (interpreted) leaves the rows past the
    # groups unzeroed; none of them may reach the output or a gradient
    ("expert8", None, "ragged", 2, "megablox"),
]


def ragged_lowered() -> int:
    """The real ragged form lowered (XLA:CPU cannot compile it): its ragged_all_to_all ops
    in the StableHLO of the layer's value and gradient (JAX checks their operands here)."""
    grad = jax.value_and_grad(lambda m, x: objective(m, x), argnums=(0, 1), has_aux=True)
    runtime = MeshRuntime.create(MESHES["expert4_data2"], make_axis_mappings())
    expert_parallel.default_form = lambda: "ragged"
    with runtime.mesh_context():
        text = jax.jit(grad).lower(layer(), X).as_text()
    return text.count("ragged_all_to_all")


def layer_diffs() -> dict:
    grad = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)
    jax.lax.ragged_all_to_all = emulated_ragged_all_to_all  # this process only (see above)
    out, single = {}, {}
    for name, capacity, form, k, matmul in LAYER_CASES:
        expert_parallel.default_form = lambda form=form: form
        mlp = layer(capacity_factor=capacity, num_experts_per_tok=k, matmul=matmul)
        if (capacity, k) not in single:  # one device, the blocked grouped matmul
            reference = layer(capacity_factor=capacity, num_experts_per_tok=k)
            single[capacity, k] = jax.jit(grad)(reference, X)
        (_, (want, want_dropped)), want_grads = single[capacity, k]
        mesh = MESHES[name]
        runtime = MeshRuntime.create(mesh, make_axis_mappings())
        placed = jax.device_put(mlp, runtime.state_shardings(mlp))
        x = jax.device_put(X, runtime.state_shardings(X, runtime.mappings.compute))
        fn = jax.jit(lambda m, x: grad(m, x))  # a fresh trace: the form is read when traced
        with runtime.mesh_context():
            compiled = fn.lower(placed, x).compile()  # run and read: one compile
            (_, (got, dropped)), grads = compiled(placed, x)
        hlo = compiled.as_text()
        leaves = zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True)
        out[f"{name} capacity={capacity} k={k} {form} {matmul}"] = {
            "out": float(np.max(np.abs(np.asarray(got) - np.asarray(want)))),
            "out_scale": float(np.max(np.abs(np.asarray(want)))),
            "grads": max(float(np.max(np.abs(a - b) / np.max(np.abs(b)))) for a, b in leaves),
            "all_to_alls": hlo.count(" all-to-all("),
            "dropped": [float(dropped), float(want_dropped)],
            "gate_spec": str(placed.gate.array.sharding.spec),
        }
    return out


def forms_agree() -> dict:
    """The ragged form (its collective emulated) against the padded one on the same inputs
    and mesh: the layer's output and every gradient, as the largest difference; dropless and
    with a receive buffer of half the mean routed rows (rows dropped)."""
    grad = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))
    runtime = MeshRuntime.create(MESHES["expert4_data2"], make_axis_mappings())
    result = {}
    for buffer in (None, 0.5):
        got = {}
        for form in FORMS:
            expert_parallel.default_form = lambda form=form: form
            mlp = layer(num_experts_per_tok=3, receive_buffer=buffer)
            placed = jax.device_put(mlp, runtime.state_shardings(mlp))
            x = jax.device_put(X, runtime.state_shardings(X, runtime.mappings.compute))
            fn = runtime.jit(lambda m, x: grad(m, x))
            (_, (out, dropped)), grads = fn(placed, x)
            arrays = [np.asarray(out), *(np.asarray(g) for g in jax.tree.leaves(grads))]
            got[form] = (arrays, float(dropped))
        pairs = zip(got["ragged"][0], got["padded"][0], strict=True)
        result[str(buffer)] = {
            "max_diff": max(float(np.max(np.abs(a - b))) for a, b in pairs),
            "arrays": len(got["ragged"][0]),
            "dropped": [got["ragged"][1], got["padded"][1]],
            "outputs": got["padded"][0],
        }
    for forms in result.values():
        forms.pop("outputs")
    return result


def recomputed_fraction() -> float:
    """The layer's ``moe/recomputed_fraction`` on expert 4 x data 2, the projections kept for
    each device's mean routed rows: the devices holding more recompute."""
    mlp = layer(saved_rows=1.0)
    runtime = MeshRuntime.create(MESHES["expert4_data2"], make_axis_mappings())
    placed = jax.device_put(mlp, runtime.state_shardings(mlp))
    x = jax.device_put(X, runtime.state_shardings(X, runtime.mappings.compute))
    run = runtime.jit(lambda m, x: m(x, RouterAux.zeros(1, m.moe.num_experts), 0)[1])
    return float(run(placed, x).metrics()["moe/recomputed_fraction"])


MODEL = MixtralConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
    moe=MoeConfig(num_experts=8, num_experts_per_tok=2, matmul_block=8),
)  # fmt: skip
VOCAB, STEPS, BATCH = 64, 5, 8


WEIGHTS: list = []
"""The one-device run's fresh Mixtral, on the host: the expert-parallel runs start from it."""


def configured(model: MixtralConfig):
    """The first run's weights in ``model``'s module (its static settings: the weights are
    the same arrays whatever the remat and saved-rows settings)."""
    shapes = jax.eval_shape(lambda: model.build(VOCAB, key=jax.random.PRNGKey(0)))
    return jax.tree.unflatten(jax.tree.structure(shapes), jax.tree.leaves(WEIGHTS[0]))


def train_losses(mesh: MeshConfig, devices, model: MixtralConfig = MODEL) -> dict:
    config = TrainerConfig(
        num_train_steps=STEPS, train_batch_size=BATCH, mesh=mesh, progress_bar=False,
        tracker=NoopTrackerConfig(), run_dir=tempfile.mkdtemp(),
    )  # fmt: skip
    optimizer = AdamConfig(learning_rate=3e-3, warmup=0).build(STEPS)
    trainer = Trainer(config, optimizer, lm_loss(), devices=devices)
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    build = lambda key: model.build(VOCAB, key=key)  # noqa: E731
    if WEIGHTS:  # placed by this mesh's mapping (initial_weights): one init compiled
        state = trainer.initial_state(build, initial_weights=lambda: configured(model))
    else:
        state = trainer.initial_state(build)
        WEIGHTS.append(jax.device_get(state.model))  # before training donates it
    gate = state.model.blocks.stacked.mlp.gate.array
    tokens = np.random.default_rng(0).integers(0, VOCAB, 40 * model.seq_len, dtype=np.int32)
    batches = BatchLoader(TokenWindows(tokens, model.seq_len), BATCH, seed=0)
    trainer.train(state, batches.iter_from(0, 0, 1))
    return {
        "losses": losses,
        "gate_spec": str(gate.sharding.spec),
        "mesh": dict(trainer.mesh.shape),
    }


def main() -> None:
    lowered = ragged_lowered()
    layers = layer_diffs()
    one = train_losses(MeshConfig(1, 1, 1), jax.devices()[:1])
    split = train_losses(MESHES["expert4_data2"], jax.devices())
    # the gate/up projections kept for the backward, up to the mean routed rows (32 a device
    # here): a device holding more takes the recompute branch, the others the kept rows
    moe = dataclasses.replace(MODEL.moe, saved_rows=1.0)
    kept_model = dataclasses.replace(MODEL, moe=moe, remat_save=("moe_up", "moe_out"))
    kept = train_losses(MESHES["expert4_data2"], jax.devices(), kept_model)
    result = {"ragged_ops": lowered, "layer": layers, "one": one, "expert4_data2": split}
    result["recomputed_fraction"] = recomputed_fraction()
    result["forms"] = forms_agree()
    print(json.dumps({**result, "expert4_data2_kept": kept}))


if __name__ == "__main__":
    main()
