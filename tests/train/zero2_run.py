"""Worker for the ZeRO-2 tests: a tiny GPT-2 trained on 8 CPU devices as plain data parallel,
ZeRO-2 and FSDP (both from data parallel's step-0 checkpoint, read into their layouts);
prints JSON (losses, per-device state bytes, the step's collectives).

  python zero2_run.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from sharded_run import MODEL, VOCAB, loader, make_trainer  # noqa: E402

from loomax.mesh import MeshConfig  # noqa: E402
from loomax.train.collectives import collectives  # noqa: E402

STRATEGIES = {
    "dp": {"fsdp_axis": None},
    "zero2": {"shard_params": False},
    "fsdp": {},
}


def device0_bytes(tree) -> int:
    """Bytes of ``tree`` held by device 0."""
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def run(settings: dict, run_dir: str, start: str | None) -> dict:
    """One strategy's run: from a fresh init saved as step 0 under ``run_dir`` (the first),
    or from that step-0 checkpoint ``start`` (the init compiled once, not per strategy)."""
    trainer = make_trainer(
        MeshConfig(1, -1, 1), run_dir, start=start, save_start=start is None, **settings
    )
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    memory = {"params": device0_bytes(state.model), "opt_state": device0_bytes(state.opt_state)}
    batch = next(iter(loader().iter_from(0)))
    # compiled ahead of time, and the steps below run this program: one compile, not two
    hlo = trainer.precompile(state, trainer.place_batch(batch)).as_text()
    ops: dict[str, int] = {}
    for c in collectives(hlo):
        ops[c.op] = ops.get(c.op, 0) + c.bytes
    trainer.train(state, loader().iter_from(0))
    return {"losses": losses, "memory": memory, "collective_bytes": ops}


def main() -> dict:
    first = tempfile.mkdtemp()
    start = str(Path(first) / "checkpoints" / "step-0")
    return {
        name: run(settings, first if i == 0 else tempfile.mkdtemp(), start if i else None)
        for i, (name, settings) in enumerate(STRATEGIES.items())
    }


if __name__ == "__main__":
    print(json.dumps(main()))
