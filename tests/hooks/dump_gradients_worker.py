"""Worker for the two-process gradient-dump (and memory, log_dir) test: one of COUNT processes, FSDP over all.

python dump_gradients_worker.py ID COUNT PORT RUN_DIR   # prints {"grad_norm", "sharded", ...}
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import process_trainer as pt  # noqa: E402  (sets the CPU platform before JAX starts)

# isort: split

import jax  # noqa: E402

from loomax.hooks import DumpGradientsHook, MemoryMonitorHook  # noqa: E402

STEPS = 2


def main() -> None:
    pid, count, port = map(int, sys.argv[1:4])
    trainer = pt.make_trainer(pid, count, port, sys.argv[4], STEPS, log_dir=f"{sys.argv[4]}/logs")
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

    trainer.train(pt.initial_state(trainer), pt.batches(pid, STEPS))
    trainer.finish()
    print(json.dumps({"process_index": pid, "run_dir": str(trainer.run_dir), **seen}))


if __name__ == "__main__":
    main()
