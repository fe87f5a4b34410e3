"""Worker for LoRA on experts under expert parallelism (8 fake CPU devices): a tiny Mixtral
with adapters on its expert weights (and attention) trained 5 steps, the base frozen through
model.lora's trainer.freeze, on one device and on expert 2 x data 4; prints JSON (losses,
the adapters' and expert weights' shardings and per-device bytes, whether the base moved).

  python lora_experts_run.py
"""

from __future__ import annotations

import json
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import MixtralConfig, MoeConfig  # noqa: E402
from loomax.models.lora.config import LoraConfig  # noqa: E402
from loomax.models.lora.linear import without_adapters  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402

LORA = LoraConfig(targets=("attn", "mlp"), rank=4, alpha=8.0)
MODEL = MixtralConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
    moe=MoeConfig(num_experts=4, num_experts_per_tok=2, matmul_block=8), lora=LORA,
)  # fmt: skip
VOCAB, STEPS, BATCH = 64, 5, 8


def placement(x) -> dict:
    """A sharded array's spec, its global and one device's bytes and shard shape."""
    shard = x.addressable_shards[0].data
    return {
        "spec": str(x.sharding.spec),
        "bytes": int(x.nbytes),
        "device_bytes": int(shard.nbytes),
        "device_shape": list(shard.shape),
    }


WEIGHTS: list = []
"""The one-device run's fresh model, on the host: the expert-parallel run starts from it."""


def run(mesh: MeshConfig, devices) -> dict:
    config = TrainerConfig(
        num_train_steps=STEPS, train_batch_size=BATCH, mesh=mesh, progress_bar=False,
        tracker=NoopTrackerConfig(), run_dir=tempfile.mkdtemp(), freeze=LORA.freeze_patterns(),
    )  # fmt: skip
    optimizer = AdamConfig(learning_rate=3e-3, warmup=0).build(STEPS)
    trainer = Trainer(config, optimizer, lm_loss(), devices=devices)
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    build = lambda key: MODEL.for_training(MODEL.build(VOCAB, key=key))  # noqa: E731
    if WEIGHTS:  # placed by the mapping of this mesh (initial_weights): one init compiled
        state = trainer.initial_state(build, initial_weights=lambda: WEIGHTS[0])
    else:
        state = trainer.initial_state(build)
        WEIGHTS.append(jax.device_get(state.model))  # before training donates it
    mlp = state.model.blocks.stacked.mlp
    base = jax.device_get(eqx.filter(without_adapters(state.model), eqx.is_inexact_array))
    arrays = {
        "gate": mlp.gate,
        "gate_lora_a": mlp.gate_lora.lora_a,
        "gate_lora_b": mlp.gate_lora.lora_b,
        "down": mlp.down,
        "down_lora_a": mlp.down_lora.lora_a,
        "down_lora_b": mlp.down_lora.lora_b,
    }
    axes = {k: [a.name for a in v.axes] for k, v in arrays.items()}
    placed = {k: placement(v.array) for k, v in arrays.items()}  # before training donates them
    tokens = np.random.default_rng(0).integers(0, VOCAB, 40 * MODEL.seq_len, dtype=np.int32)
    batches = BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=0)
    final = trainer.train(state, batches.iter_from(0, 0, 1)).state
    after = jax.device_get(eqx.filter(without_adapters(final.model), eqx.is_inexact_array))
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), base, after)
    moved = np.abs(np.asarray(final.model.blocks.stacked.mlp.up_lora.lora_b.array)).max()
    return {
        "losses": losses,
        "mesh": dict(trainer.mesh.shape),
        "axes": axes,
        "placement": placed,
        "base_unchanged": all(jax.tree.leaves(same)),
        "up_lora_b_max": float(moved),
    }


def main() -> None:
    one = run(MeshConfig(1, 1, 1), jax.devices()[:1])
    split = run(MeshConfig(1, 4, 1, expert=2), jax.devices())
    print(json.dumps({"one": one, "expert2_data4": split}))


if __name__ == "__main__":
    main()
