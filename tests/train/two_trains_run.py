"""Worker for the stop/save/eval agreement test: two ``Trainer.train`` calls in one multi-process job.

  python two_trains_run.py ID COUNT PORT RUN_ROOT     # prints [{"final_step", "stop_reason"}, ...]

As ``loomax ladder run`` does, every process trains two models one after the other. In the
first, the last process asks for a stop at step 2; the second must run all its steps.
"""

from __future__ import annotations

import json
import os
import sys

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
VOCAB, BATCH, STEPS, STOP_AT = 48, 4, 4, 2


def train_once(pid: int, count: int, port: int, run_dir: str, stop_at: int | None) -> dict:
    config = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=BATCH,
        mesh=MeshConfig(1, -1, 1),
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=run_dir,
        distributed=DistributedConfig(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
        ),
    )
    optimizer = AdamConfig(learning_rate=1e-3, warmup=0)
    trainer = Trainer(config, optimizer.build(STEPS), lm_loss(), run_id=setup_process(config))
    if stop_at is not None and jax.process_index() == count - 1:

        def stop(info) -> None:
            if info.step == stop_at:
                info.control.stop("asked by the test")

        trainer.add_hook(stop, every=1)
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    rng = np.random.default_rng(pid)
    rows = BATCH // jax.process_count()
    batches = (rng.integers(0, VOCAB, (rows, MODEL.seq_len), dtype=np.int32) for _ in range(STEPS))
    final = trainer.train(state, batches)
    trainer.finish()
    return {"final_step": final.step, "stop_reason": trainer.stop_reason}


def main() -> None:
    pid, count, port = map(int, sys.argv[1:4])
    root = sys.argv[4]
    first = train_once(pid, count, port, f"{root}/first", stop_at=STOP_AT)
    second = train_once(pid, count, port, f"{root}/second", stop_at=None)
    print(json.dumps([first, second]))


if __name__ == "__main__":
    main()
