"""Worker for the two-process gradient-dump (and memory, log_dir) test: one of COUNT processes, FSDP over all.

python dump_gradients_worker.py ID COUNT PORT RUN_DIR   # prints {"grad_norm", "sharded", ...}
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.callbacks import DumpGradientsHook, MemoryMonitorHook  # noqa: E402
from loomax.distributed import DistributedConfig  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import Gpt2Config  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig, setup_process  # noqa: E402

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=1, num_heads=2)
VOCAB, BATCH, STEPS = 48, 4, 2


def main() -> None:
    pid, count, port = map(int, sys.argv[1:4])
    config = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=BATCH,
        mesh=MeshConfig(1, -1, 1),
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=sys.argv[4],
        log_dir=f"{sys.argv[4]}/logs",
        distributed=DistributedConfig(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
        ),
    )
    optimizer = AdamConfig(learning_rate=1e-3, warmup=0)
    trainer = Trainer(config, optimizer.build(STEPS), lm_loss(), run_id=setup_process(config))
    logging.getLogger("loomax.test").info("worker %d of %d here", pid, count)  # into its log file
    primary = jax.process_index() == 0
    trainer.add_hook(DumpGradientsHook(steps=[2], run_dir=trainer.run_dir, write=primary))
    trainer.add_hook(MemoryMonitorHook(every=2, per_process=True))
    seen = {}

    @trainer.add_hook(every=2, priority=-1000)  # after the memory hook: its record is there
    def grad_norm(info):
        seen["memory"] = {k: v for k, v in info.record.items() if k.startswith("memory/")}
        seen["grad_norm"] = info.host_metrics()["optim/grad_norm"]
        weight = info.state.model.token_embeddings.weight.array
        seen["sharded"] = not weight.is_fully_addressable

    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    rng = np.random.default_rng(pid)
    rows = BATCH // jax.process_count()
    batches = (rng.integers(0, VOCAB, (rows, MODEL.seq_len), dtype=np.int32) for _ in range(STEPS))
    trainer.train(state, batches)
    trainer.finish()
    print(json.dumps({"process_index": pid, "run_dir": str(trainer.run_dir), **seen}))


if __name__ == "__main__":
    main()
