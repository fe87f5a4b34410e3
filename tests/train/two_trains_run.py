"""Worker for the stop/save/eval agreement test: two ``Trainer.train`` calls in one multi-process job.

  python two_trains_run.py ID COUNT PORT RUN_ROOT     # prints [{"final_step", "stop_reason", "run_id"}, ...]

As ``loomax ladder run`` does, every process trains two models one after the other. In the
first, the last process asks for a stop at step 2; the second must run all its steps. Neither
is given a run id: every process takes process 0's (the second's run dir may record one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import process_trainer as pt  # noqa: E402  (sets the CPU platform before JAX starts)

# isort: split

import jax  # noqa: E402

STEPS, STOP_AT = 4, 2


def train_once(pid: int, count: int, port: int, run_dir: str, stop_at: int | None) -> dict:
    trainer = pt.make_trainer(pid, count, port, run_dir, STEPS)
    if stop_at is not None and jax.process_index() == count - 1:

        def stop(info) -> None:
            if info.step == stop_at:
                info.control.stop("asked by the test")

        trainer.add_hook(stop, every=1)
    final = trainer.train(pt.initial_state(trainer), pt.batches(pid, STEPS))
    trainer.finish()
    return {"final_step": final.step, "stop_reason": trainer.stop_reason, "run_id": trainer.run_id}


def main() -> None:
    pid, count, port = map(int, sys.argv[1:4])
    root = sys.argv[4]
    first = train_once(pid, count, port, f"{root}/first", stop_at=STOP_AT)
    second = train_once(pid, count, port, f"{root}/second", stop_at=None)
    print(json.dumps([first, second]))


if __name__ == "__main__":
    main()
