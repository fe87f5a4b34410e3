"""What 1F1B is for, compile only (issue 67): the compiled train step's temporaries per device
under GPipe and 1F1B as the microbatches double, on 8 fake CPU devices.

  python bench/pipeline_memory.py [--out FILE]

The pipeline test's tiny Llama (8 layers, width 32, seq 16, vocab 64) as stage 4 x data 2,
microbatches of 2 rows, 8 then 16 of them (batch 16, 32): XLA's memory analysis of each
compiled step (``temp_size_in_bytes``, per device), printed side by side with the growth
per added microbatch. GPipe keeps every microbatch's activations until the backward; 1F1B
holds at most ``p`` stage inputs (its buffers: ``pipeline_explicit.control``). No figure
here is a time. The results file records ``XLA_FLAGS`` (the figures in docs/pipeline.md
were taken with the test suite's, ``tests/conftest.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.models.blocks.pipeline_explicit import control  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.stages import PipelineConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402
from machine import cpu_name  # noqa: E402

MODEL = LlamaConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=8, num_heads=4, num_kv_heads=2
)  # fmt: skip
VOCAB, ROWS, STAGES = 64, 2, 4
SCHEDULES, MICROBATCHES = ("gpipe", "1f1b"), (8, 16)


def temp_bytes(schedule: str, m: int) -> int:
    """Temporaries per device of the step compiled for ``m`` microbatches of ``ROWS`` rows."""
    config = TrainerConfig(
        num_train_steps=1, train_batch_size=ROWS * m, mesh=MeshConfig(data=2, stage=STAGES),
        pipeline=PipelineConfig(schedule=schedule, microbatches=m), progress_bar=False,
        tracker=NoopTrackerConfig(), run_dir=tempfile.mkdtemp(),
    )  # fmt: skip
    trainer = Trainer(config, AdamConfig(learning_rate=3e-3, warmup=0).build(1), lm_loss())
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    tokens = trainer.place_batch(np.zeros((ROWS * m, MODEL.seq_len), np.int32))
    return int(trainer.precompile(state, tokens).memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results JSON (default: print only)")
    args = parser.parse_args(argv)
    lo, hi = MICROBATCHES
    results = {}
    print(f"{'schedule':>9} {'m = ' + str(lo):>12} {'m = ' + str(hi):>12} {'per microbatch':>15}")
    for schedule in SCHEDULES:
        mem = {m: temp_bytes(schedule, m) for m in MICROBATCHES}
        growth = (mem[hi] - mem[lo]) / (hi - lo)
        results[schedule] = {
            "temp_bytes_per_device": {str(m): b for m, b in mem.items()},
            "growth_per_microbatch": round(growth),
        }
        print(f"{schedule:>9} {mem[lo]:>12,} {mem[hi]:>12,} {growth:>15,.0f}", flush=True)
    buffers = {str(m): list(control("1f1b", STAGES, m, 1)[1:]) for m in MICROBATCHES}
    g, f = (results[s]["growth_per_microbatch"] for s in SCHEDULES)
    print(f"1F1B's growth / GPipe's: {f / g:.3f}; 1F1B's buffers (inputs, cotangents): {buffers}")
    out = {
        "what": "XLA memory analysis temp_size_in_bytes per device of the compiled train step, "
        "compile only",
        "model": "Llama 8 layers, hidden 32, intermediate 64, seq 16, vocab 64",
        "mesh": f"stage {STAGES} x data 2 (8 fake CPU devices)",
        "rows_per_microbatch": ROWS,
        "cpu": f"{cpu_name()}, {os.cpu_count()} cores (shared, loaded: no figure here is a time)",
        "xla_flags": os.environ["XLA_FLAGS"].strip(),
        "date": datetime.date.today().isoformat(),
        "results": results,
        "growth_ratio_1f1b_to_gpipe": round(f / g, 3),
        "1f1b_buffers_inputs_cotangents": buffers,
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
