"""Worker for the multi-process control-server test: one of COUNT processes training, once
per command, until told to stop.

  python control_worker.py ID COUNT PORT RUN_DIR CMD...  # per CMD, a run in RUN_DIR/CMD that
                                                         # prints {"final_step", "stop_reason", ...}

Only process 0 serves HTTP; a command must still stop every process at the same step (an
abort: every process raises ``RunAborted``, printed as {"aborted": message, ...}). The runs
follow one another in the same processes (one JAX start for all the commands).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import process_trainer as pt  # noqa: E402  (sets the CPU platform before JAX starts)

# isort: split

import jax  # noqa: E402

from loomax.hooks import ControlServerHook  # noqa: E402
from loomax.hooks.control_server import RunAborted  # noqa: E402

STEPS = 100_000


def run(pid: int, count: int, port: int, run_dir: str, command: str) -> dict:
    trainer = pt.make_trainer(
        pid, count, port, run_dir, STEPS, max_train_time=timedelta(seconds=180)
    )
    trainer.add_hook(ControlServerHook(run_dir=trainer.run_dir, serve=jax.process_index() == 0))
    result = {"command": command, "process_index": jax.process_index()}
    try:
        final = trainer.train(pt.initial_state(trainer), pt.batches(pid, STEPS))
    except RunAborted as error:
        trainer.finish()
        return {**result, "aborted": str(error), "saved_step": trainer.checkpointer.last_saved_step}
    trainer.finish()
    return {
        **result,
        "final_step": final.step,
        "stop_reason": trainer.stop_reason,
        "saved_step": trainer.checkpointer.last_saved_step,
    }


def main() -> None:
    pid, count, port = map(int, sys.argv[1:4])
    for command in sys.argv[5:]:
        print(
            json.dumps(run(pid, count, port, str(Path(sys.argv[4]) / command), command)), flush=True
        )


if __name__ == "__main__":
    main()
