"""Worker for the sharding tests: train a tiny GPT-2 for 5 steps on given meshes, print JSON.

Run as a subprocess (the device count is fixed when JAX starts):
  python sharded_run.py meshes '[[1,1,1,1], [1,8,1,8], ...]'     # replica, data, model, devices
  python sharded_run.py process ID COUNT PORT                        # one of COUNT processes, mesh data=4
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.distributed import DistributedConfig  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import Gpt2Config  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402
from loomax.train_lm import lm_loss  # noqa: E402

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)
VOCAB, STEPS, BATCH = 64, 5, 8


def loader() -> BatchLoader:
    tokens = np.random.default_rng(0).integers(0, VOCAB, 40 * MODEL.seq_len, dtype=np.int32)
    return BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=0)


def run(mesh: MeshConfig, devices=None, distributed: DistributedConfig | None = None) -> dict:
    config = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=BATCH,
        mesh=mesh,
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        distributed=distributed or DistributedConfig(),
    )
    optimizer = AdamConfig(learning_rate=3e-3, warmup=0)
    trainer = Trainer(config, optimizer.build(STEPS), lm_loss(), devices=devices)
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
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
    final = trainer.train(state, loader().iter_from(0, jax.process_index(), jax.process_count()))
    return {
        "losses": losses,
        "specs": specs,
        "final_step": final.step,
        "mesh": dict(trainer.mesh.shape),
    }


def main() -> None:
    mode = sys.argv[1]
    if mode == "meshes":
        out = []
        for replica, data, model, n in json.loads(sys.argv[2]):
            out.append(run(MeshConfig(replica, data, model), devices=jax.devices()[:n]))
        print(json.dumps(out))
    elif mode == "process":
        pid, count, port = map(int, sys.argv[2:5])
        dist = DistributedConfig(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
        )
        result = run(MeshConfig(1, -1, 1), distributed=dist)
        result["process_index"], result["process_count"] = jax.process_index(), jax.process_count()
        print(json.dumps(result))


if __name__ == "__main__":
    main()
