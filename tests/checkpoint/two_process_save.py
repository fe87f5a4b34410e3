"""Worker: one of two JAX processes saving a sharded array; process 1's second write fails.

  python two_process_save.py ID PORT BASE

Prints one JSON line: what each save did (``ok`` or the error text) and how long it took.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from loomax.checkpoint import Checkpointer, CheckpointerConfig, CheckpointSaveError  # noqa: E402
from loomax.checkpoint import checkpointer as checkpointer_module  # noqa: E402


def main() -> None:
    me, port, base = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=me)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    tree = {"w": jax.make_array_from_callback((4, 2), sharding, lambda i: np.ones((4, 2))[i])}
    ckpt = Checkpointer(CheckpointerConfig(), base, run_id="two")
    outcome = {}
    for step in (1, 2):
        if step == 2 and me == 1:  # a full disk on this host only

            def no_space(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            checkpointer_module.write_snapshot = no_space
        started = time.perf_counter()
        try:
            ckpt.save(step, tree, {}, permanent=True, block=True)
            outcome[step] = "ok"
        except CheckpointSaveError as e:
            outcome[step] = str(e)
        outcome[f"{step}_seconds"] = time.perf_counter() - started
    print(json.dumps(outcome))


if __name__ == "__main__":
    main()
