"""The bubble of a staged step read off its traced program (``plan/stage_loop.py``): a tiny
Llama over stage 2 x data 2 of a TPU slice, traced (not compiled) under GPipe and 1F1B."""

from __future__ import annotations

import functools

import pytest

pytestmark = pytest.mark.usefixtures("libtpu")  # in the test extra: fails, not skips, without it

from loomax.config import parse_config  # noqa: E402
from loomax.lm.config import TrainLmConfig  # noqa: E402
from loomax.pipeline_schedules import table  # noqa: E402
from loomax.plan.build import built_step  # noqa: E402
from loomax.plan.stage_loop import bubble_text, pipeline_bubble, stage_loops  # noqa: E402
from loomax.plan.topology import get_topology  # noqa: E402

topology = functools.cache(get_topology)  # libtpu makes the devices once per process

TINY = [
    "--model.type", "llama", "--model.seq_len", "32", "--model.num_layers", "4",
    "--model.vocab_size", "256", "--model.hidden_dim", "32", "--model.intermediate_dim", "64",
    "--model.num_heads", "2", "--model.num_kv_heads", "2", "--trainer.train_batch_size", "8",
    "--trainer.mesh.stage", "2", "--trainer.mesh.data", "2",
    "--trainer.pipeline.microbatches", "4",
]  # fmt: skip


@functools.cache
def traced(schedule: str):
    config = parse_config(TrainLmConfig, None, [*TINY, "--trainer.pipeline.schedule", schedule])
    with built_step(config, topology("v5p:2x2x1").devices) as built:
        jaxpr = built.trace().jaxpr
    return jaxpr, pipeline_bubble(jaxpr, config.trainer.pipeline, 2)


def test_gpipe_idles_its_formula_in_slots_and_in_its_count():
    jaxpr, found = traced("gpipe")
    assert sorted(loop.slots for loop in stage_loops(jaxpr) if loop.slots > 1) == [5, 5]
    assert (found.slots, found.busy) == (5, 4)  # m + p - 1 slots, the forward and its transpose
    assert found.formula == found.slots_bubble == found.counted == pytest.approx(1 / 5)
    assert found.lockstep is None


def test_1f1b_counts_every_slot_at_its_costliest_branch():
    """The explicit loop has the table's slots (2 m busy): the formula's bubble in slots. Its
    FLOP count takes every slot at the costliest branch of its switch (the last stage's
    backward with the loss), so the count implies more idle than the slots, and a lockstep
    slot (as long as its busiest stage) less than that."""
    _, found = traced("1f1b")
    assert found.slots == len(table("1f1b", 2, 4, backward_slots=1).slots) == 10
    assert found.busy == 8 and found.slots_bubble == pytest.approx(found.formula) == 1 / 5
    assert found.slots_bubble < found.lockstep < found.counted < 1
    line = bubble_text(found.to_json())
    assert line.startswith("pipeline: 1f1b over 2 stages, 4 microbatches: a loop of 10 slots")
    assert "bubble (estimates): formula 20.0%, slots 20.0%, counted" in line
