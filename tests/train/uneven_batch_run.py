"""Worker for trainer.allow_nondivisible_batch_size: 3 sequences a step over 2 devices.

Run as a subprocess (the device count is fixed when JAX starts); prints JSON: the losses
of 3 steps on data=2 and on one device, and the error without the option.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import Gpt2Config  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=2)


def losses(run_dir: str, data: int, devices, allow: bool = True) -> list[float]:
    config = TrainerConfig(
        num_train_steps=3, train_batch_size=3, allow_nondivisible_batch_size=allow,
        mesh=MeshConfig(data=data), run_dir=run_dir, progress_bar=False,
        tracker=NoopTrackerConfig(),
    )  # fmt: skip
    opt = AdamConfig(learning_rate=1e-2, warmup=0, lr_schedule="constant")
    trainer = Trainer(config, opt.build(3), lm_loss(), devices=devices)
    seen: list[float] = []
    trainer.add_hook(lambda info: seen.append(info.loss))
    rng = np.random.default_rng(0)
    batches = (rng.integers(0, 64, (3, 16), dtype=np.int32) for _ in range(3))
    trainer.train(trainer.initial_state(lambda key: MODEL.build(64, key=key)), batches)
    trainer.finish()
    return seen


if __name__ == "__main__":
    out_dir = sys.argv[1]
    two = losses(f"{out_dir}/two", 2, jax.devices()[:2])
    one = losses(f"{out_dir}/one", 1, jax.devices()[:1])
    try:
        losses(f"{out_dir}/off", 2, jax.devices()[:2], allow=False)
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = str(e)
    print(json.dumps({"two": two, "one": one, "error": error}))
