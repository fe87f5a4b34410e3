"""Worker for the multi-process control-server test: one of COUNT processes training until told to stop.

  python control_worker.py ID COUNT PORT RUN_DIR     # prints {"final_step", "stop_reason", ...}

Only process 0 serves HTTP; a command must still stop every process at the same step (an
abort: every process raises ``RunAborted``, printed as {"aborted": message, ...}).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.callbacks import ControlServerHook  # noqa: E402
from loomax.callbacks.control_server import RunAborted  # noqa: E402
from loomax.distributed import DistributedConfig  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import Gpt2Config  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig, setup_process  # noqa: E402

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=1, num_heads=2)
VOCAB, BATCH, STEPS = 48, 4, 100_000


def main() -> None:
    pid, count, port = map(int, sys.argv[1:4])
    run_dir = sys.argv[4]
    config = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=BATCH,
        mesh=MeshConfig(1, -1, 1),
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=run_dir,
        max_train_time=timedelta(seconds=180),
        distributed=DistributedConfig(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
        ),
    )
    optimizer = AdamConfig(learning_rate=1e-3, warmup=0)
    trainer = Trainer(config, optimizer.build(STEPS), lm_loss(), run_id=setup_process(config))
    trainer.add_hook(ControlServerHook(run_dir=trainer.run_dir, serve=jax.process_index() == 0))
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    rng = np.random.default_rng(pid)
    rows = BATCH // jax.process_count()
    batches = (rng.integers(0, VOCAB, (rows, MODEL.seq_len), dtype=np.int32) for _ in range(STEPS))
    try:
        final = trainer.train(state, batches)
    except RunAborted as error:
        trainer.finish()
        saved = trainer.checkpointer.last_saved_step
        print(
            json.dumps(
                {"process_index": jax.process_index(), "aborted": str(error), "saved_step": saved}
            )
        )
        return
    trainer.finish()
    print(
        json.dumps(
            {
                "process_index": jax.process_index(),
                "final_step": final.step,
                "stop_reason": trainer.stop_reason,
                "saved_step": trainer.checkpointer.last_saved_step,
            }
        )
    )


if __name__ == "__main__":
    main()
