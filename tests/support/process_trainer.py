"""A tiny GPT-2 trainer as one of COUNT JAX processes on 127.0.0.1 (FSDP over every
device), and its per-process batches: the setup the multi-process worker scripts share.

A worker script puts this folder on ``sys.path`` and imports it before JAX (it sets the
CPU platform).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.distributed import DistributedConfig  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import Gpt2Config  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig, setup_process  # noqa: E402

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=1, num_heads=2)
VOCAB, BATCH = 48, 4


def make_trainer(pid: int, count: int, port: int, run_dir: str, steps: int, **settings) -> Trainer:
    """Process ``pid`` of ``count`` (coordinator on ``port``) training ``steps`` steps of the
    tiny model, data parallel with FSDP over all devices; ``settings`` go to ``TrainerConfig``."""
    config = TrainerConfig(
        num_train_steps=steps,
        train_batch_size=BATCH,
        mesh=MeshConfig(1, -1, 1),
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=run_dir,
        distributed=DistributedConfig(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
        ),
        **settings,
    )
    optimizer = AdamConfig(learning_rate=1e-3, warmup=0, lr_schedule="constant")
    return Trainer(config, optimizer.build(steps), lm_loss(), run_id=setup_process(config))


def initial_state(trainer: Trainer):
    """The tiny model's initial state for ``trainer``."""
    return trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))


def batches(pid: int, steps: int) -> Iterator[np.ndarray]:
    """This process's rows of each of ``steps`` random batches (seeded by ``pid``)."""
    rng = np.random.default_rng(pid)
    rows = BATCH // jax.process_count()
    return (rng.integers(0, VOCAB, (rows, MODEL.seq_len), dtype=np.int32) for _ in range(steps))
