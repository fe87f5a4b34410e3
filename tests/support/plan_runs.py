"""Tiny GPT-2 and Llama run configs for the compile tests, and their compiles, once per process.

Shared by tests/plan/test_compile.py (TPU topologies) and tests/plan/test_gpus.py (GPU
topologies) through the `plan_runs` fixture: a topology's compile takes seconds, and a few
tests read the same one.
"""

from __future__ import annotations

import functools

from loomax.config import parse_config
from loomax.lm.config import TrainLmConfig
from loomax.plan.compile import CompileResult, compile_run
from loomax.plan.topology import get_topology

TINY = {
    "gpt2": ["--model.type", "gpt2", "--model.hidden_dim", "64", "--model.num_heads", "4"],
    "llama": ["--model.type", "llama", "--model.hidden_dim", "64", "--model.intermediate_dim", "128"],
}  # fmt: skip
COMMON = [
    "--model.seq_len", "64", "--model.num_layers", "2", "--model.vocab_size", "512",
    "--trainer.train_batch_size", "8", "--trainer.mp", "p=f32,c=bfloat16",
]  # fmt: skip


def tiny(model: str, *extra: str) -> TrainLmConfig:
    """The tiny ``model`` (``gpt2`` or ``llama``) run config, with ``extra`` flags."""
    return parse_config(TrainLmConfig, None, [*TINY[model], *COMMON, *extra])


@functools.cache
def compiled(model: str, topology: str, *extra: str) -> CompileResult:
    """``compile_run`` of ``tiny(model, *extra)`` on ``topology``, once per process."""
    return compile_run(tiny(model, *extra), get_topology(topology))
