"""Worker for the rollout tests: the same rows and keys sampled with the policy sharded as the
trainer shards it on 8 CPU devices (data parallel, FSDP weights) and on 1; prints JSON.

  python rollout_devices_run.py
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.rl.rollout import generate, row_keys  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402
from loomax.train import TrainerConfig  # noqa: E402


def sample(devices):
    config = LlamaConfig(seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2,
                         num_heads=2, num_kv_heads=1)  # fmt: skip
    runtime = MeshRuntime.create(MeshConfig(), TrainerConfig().axis_mappings(), devices)
    model = config.build(64, key=jax.random.PRNGKey(0))
    model = jax.device_put(model, runtime.state_shardings(model))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, int(rng.integers(1, 9))).tolist() for _ in range(16)]
    rolled = generate(model, prompts, row_keys(jax.random.PRNGKey(3), 16), seq_len=32,
                      max_new_tokens=10, temperature=1.0, top_p=0.9, stop_token=7,
                      mesh=runtime.mesh)  # fmt: skip
    return {"tokens": rolled.tokens.tolist(), "length": rolled.length.tolist(),
            "logp": rolled.logp.tolist(), "data": runtime.data_parallel_size}  # fmt: skip


if __name__ == "__main__":
    devices = jax.devices()
    print(json.dumps({"eight": sample(devices), "one": sample(devices[:1])}))
