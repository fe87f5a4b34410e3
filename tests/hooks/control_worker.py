"""Worker for the multi-process control-server test: one of COUNT processes training until told to stop.

  python control_worker.py ID COUNT PORT RUN_DIR     # prints {"final_step", "stop_reason", ...}

Only process 0 serves HTTP; a command must still stop every process at the same step (an
abort: every process raises ``RunAborted``, printed as {"aborted": message, ...}).
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


def main() -> None:
    pid, count, port = map(int, sys.argv[1:4])
    trainer = pt.make_trainer(
        pid, count, port, sys.argv[4], STEPS, max_train_time=timedelta(seconds=180)
    )
    trainer.add_hook(ControlServerHook(run_dir=trainer.run_dir, serve=jax.process_index() == 0))
    try:
        final = trainer.train(pt.initial_state(trainer), pt.batches(pid, STEPS))
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
