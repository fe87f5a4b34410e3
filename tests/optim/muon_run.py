"""Worker for tests/optim/test_muon_sharded.py, on 8 fake CPU devices; prints one JSON line.

  python muon_run.py

* ``losses``: a tiny Llama trained with Muon on one device and on FSDP 8 (data=8), the latter
  from the former's step-0 checkpoint.
* ``updates``: Muon's update (two steps) of a tiny Mixtral's parameters (stacked layers,
  experts: Linear and bare expert weights) from the same gradients, on one device and on
  data 2 x expert 2 x model 2 (FSDP, expert and tensor parallel at once): the largest
  difference from one device.
* ``scaling``: only Muon's update (compiled, not run) of a stack of ``layers`` matrices:
  1 device x 1 layer, 8 devices x 8 layers (the same work per device: weak scaling) split
  and not split, 8 devices x 1 layer; XLA's FLOPs and temporaries per device.
* ``experts``: only Muon's update (compiled) of a mixture's bare expert weights resting on
  ``experts -> expert``, ``embed -> data``: 4 experts on data 2 x expert 2, 8 experts on
  data 2 x expert 4 (the same share per device); XLA's FLOPs and temporaries per device.
"""

from __future__ import annotations

import json
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import haliax.nn as hnn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from loomax.checkpoint import CheckpointerConfig  # noqa: E402
from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MESH_AXES, MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models import LlamaConfig, MixtralConfig, MoeConfig  # noqa: E402
from loomax.optim import MuonConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402

MODEL = LlamaConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
    gradient_checkpointing=False,
)  # fmt: skip
MOE = MixtralConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
    moe=MoeConfig(num_experts=4, num_experts_per_tok=2),
)  # fmt: skip
VOCAB, STEPS, BATCH = 64, 4, 8
OPTIMIZER = MuonConfig(learning_rate=3e-3, warmup=0, lr_schedule="constant")
MESHES = {"one_device": MeshConfig(1, 1, 1), "fsdp8": MeshConfig(1, 8, 1)}
UPDATE_MESHES = {"data2_expert2_model2": MeshConfig(1, 2, 2, expert=2)}


def losses(mesh: MeshConfig, start: str | None = None, run_dir: str | None = None) -> list[float]:
    """The Llama's losses on ``mesh``: from a fresh init, saved as step 0 under ``run_dir``,
    or from such a step-0 checkpoint ``start`` (the init compiled once, not per mesh)."""
    devices = jax.devices()[: len(jax.devices()) if mesh.data != 1 else 1]
    config = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=BATCH,
        mesh=mesh,
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        load_checkpoint=start is not None,
        load_checkpoint_path=start,
        checkpointer=CheckpointerConfig(save_at_start=start is None, save_at_end=False),
        run_dir=run_dir or tempfile.mkdtemp(),
    )
    trainer = Trainer(config, OPTIMIZER.build(STEPS), lm_loss(), devices=devices)
    out: list[float] = []
    trainer.add_hook(lambda info: out.append(info.loss))
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    tokens = np.tile(np.arange(VOCAB, dtype=np.int32), 12)
    trainer.train(
        state, BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=0).iter_from(0)
    )
    trainer.finish()
    return out


def update_differences() -> dict[str, float]:
    """Largest |difference| from one device of two Muon updates of a tiny Mixtral, per mesh."""
    # the Mixtral's parameter tree (shapes only: no init run op by op, one program a shape),
    # parameters and gradients drawn on the host: nothing compiled but the updates
    shapes = eqx.filter(
        jax.eval_shape(lambda: MOE.build(VOCAB, key=jax.random.PRNGKey(0))),
        lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact),
    )
    leaves, treedef = jax.tree.flatten(shapes)
    rng = np.random.default_rng(0)
    params, grads = (
        jax.tree.unflatten(
            treedef, [(rng.standard_normal(x.shape) * scale).astype(x.dtype) for x in leaves]
        )  # fmt: skip
        for scale in (0.02, 1.0)
    )
    tx = OPTIMIZER.direction()

    def two_updates(g, p):
        state = tx.init(p)
        first, state = tx.update(g, state, p)
        second, _ = tx.update(jax.tree.map(lambda x: -0.5 * x, g), state, p)
        return first, second

    reference = jax.jit(two_updates)(grads, params)
    out = {}
    for name, config in UPDATE_MESHES.items():
        mesh = config.build(jax.devices())
        mapping = make_axis_mappings().parameter
        with hax.partitioning.set_mesh(mesh), hax.axis_mapping(make_axis_mappings().compute):
            shard = hax.partitioning.infer_resource_partitions(
                params, mapping, preserve_existing_shardings=False, mesh=mesh
            )
            placed = jax.device_put((grads, params), (shard, shard))
            got = jax.jit(two_updates)(*placed)
        diffs = jax.tree.map(  # on the host: no program a leaf shape
            lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), got, reference
        )
        out[name] = max(jax.tree.leaves(diffs))
    return out


EMBED, MLP = 256, 512


def compiled_update(tx, params, mapping: dict, mesh: Mesh) -> tuple[dict, str, int]:
    """XLA's cost analysis, HLO text and temporaries' bytes of ``tx``'s update, compiled only, with the
    gradients, parameters and state split by ``mapping`` over ``mesh``."""
    with hax.partitioning.set_mesh(mesh):
        shardings = hax.partitioning.infer_resource_partitions(
            params, mapping, preserve_existing_shardings=False, mesh=mesh
        )
        state = jax.eval_shape(tx.init, params)
        state_shardings = hax.partitioning.infer_resource_partitions(
            state, mapping, preserve_existing_shardings=False, mesh=mesh
        )
        step = jax.jit(
            lambda g, s: tx.update(g, s, g),
            in_shardings=(shardings, state_shardings),
            out_shardings=(shardings, state_shardings),
        )
        compiled = step.lower(params, state).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost, compiled.as_text(), int(compiled.memory_analysis().temp_size_in_bytes)


def update_cost(devices: int, layers: int, split: bool) -> dict:
    """XLA's per-device FLOPs and temporaries of Muon's direction on ``layers`` stacked
    (embed, mlp) Linear weights split FSDP-style (``embed -> data``), compiled only."""
    L, E, M = hax.Axis("layers", layers), hax.Axis("embed", EMBED), hax.Axis("mlp", MLP)
    linear = hnn.Linear.init(E, M, key=jax.random.PRNGKey(0), use_bias=False)
    shape = jax.ShapeDtypeStruct((layers, EMBED, MLP), jnp.float32)
    params = {"up": eqx.tree_at(lambda m: m.weight, linear, hax.NamedArray(shape, (L, E, M)))}
    params = eqx.filter(params, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    grid = np.array(jax.devices()[:devices]).reshape(1, devices, 1, 1, 1, 1)
    mesh = Mesh(grid, MESH_AXES)
    tx = MuonConfig(split_newton_schulz=split).direction()
    cost, hlo, temp_bytes = compiled_update(tx, params, {"embed": "data"}, mesh)
    return {
        "devices": devices,
        "layers": layers,
        "split": split,
        "flops": float(cost["flops"]),
        "temp_bytes": temp_bytes,
        "all_to_all": hlo.count("all-to-all("),
        "all_reduce": hlo.count("all-reduce("),
        "all_gather": hlo.count("all-gather("),
    }


EXPERT_LAYERS, EXPERT_EMBED, EXPERT_MLP = 2, 64, 128


def expert_update_cost(data: int, expert: int, experts: int) -> dict:
    """XLA's per-device temporaries and FLOPs of Muon's direction on a mixture's bare expert
    weights (gate, up: ``(layers, experts, embed, mlp)``; down: ``(layers, experts, mlp,
    embed)``) resting as the trainer keeps them (``experts -> expert``, ``embed -> data``) on
    ``data x expert`` devices, compiled only."""
    L, X = hax.Axis("layers", EXPERT_LAYERS), hax.Axis("experts", experts)
    E, M = hax.Axis("embed", EXPERT_EMBED), hax.Axis("mlp", EXPERT_MLP)

    def bare(*axes):
        return hax.NamedArray(jax.ShapeDtypeStruct(tuple(a.size for a in axes), jnp.float32), axes)

    params = {"gate": bare(L, X, E, M), "up": bare(L, X, E, M), "down": bare(L, X, M, E)}
    grid = np.array(jax.devices()[: data * expert]).reshape(1, data, expert, 1, 1, 1)
    mesh = Mesh(grid, MESH_AXES)
    tx = MuonConfig().direction()
    mapping = {"embed": "data", "experts": "expert"}
    cost, hlo, temp_bytes = compiled_update(tx, params, mapping, mesh)
    return {
        "devices": data * expert,
        "experts": experts,
        "flops": float(cost["flops"]),
        "temp_bytes": temp_bytes,
        "all_gather": hlo.count("all-gather("),
        "all_to_all": hlo.count("all-to-all("),
    }


def main() -> dict:
    scaling = {
        "one_device_1_layer": update_cost(1, 1, True),
        "fsdp8_8_layers": update_cost(8, 8, True),
        "fsdp8_8_layers_not_split": update_cost(8, 8, False),
        "one_device_8_layers": update_cost(1, 8, True),
    }
    first = tempfile.mkdtemp()
    experts = {
        "data2_expert2_4_experts": expert_update_cost(2, 2, 4),
        "data2_expert4_8_experts": expert_update_cost(2, 4, 8),
    }
    return {
        "experts": experts,
        "losses": {
            "one_device": losses(MESHES["one_device"], run_dir=first),
            "fsdp8": losses(MESHES["fsdp8"], start=os.path.join(first, "checkpoints", "step-0")),
        },
        "updates": update_differences(),
        "scaling": scaling,
    }


if __name__ == "__main__":
    print(json.dumps(main()))
