"""The explicit pipeline loop's control table: every action once, in dependency order, with
buffers for at most the microbatches a stage holds (about ``p``, whatever ``m``). The loop
itself is checked against one device in ``test_pipeline.py`` (8 CPU devices)."""

from __future__ import annotations

import pytest

from loomax.models.blocks.pipeline_explicit import BWD_TAIL, FWD, IDLE, WGT, control


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_stage_buffers_do_not_grow_with_the_microbatches(name, v):
    sizes = [control(name, 4, m, v)[1:] for m in (8, 16, 32)]
    assert sizes[0] == sizes[1] == sizes[2]
    inputs, cotangents = sizes[0]
    assert inputs <= 4 * v + 2 and cotangents <= 4 * v  # GPipe would need m


def test_1f1b_control_runs_each_action_once_after_its_input_arrived():
    ctrl, inputs, _ = control("1f1b", 4, 8, 1)
    assert ctrl.shape == (22, 4, 7)  # 2 (m + p - 1) slots
    code, mb, chunk = ctrl[..., 0], ctrl[..., 1], ctrl[..., 2]
    assert (code != IDLE).sum(axis=0).tolist() == [16, 16, 16, 16]  # F and B of 8 microbatches
    assert (code[:, 3] == BWD_TAIL).sum() == 8  # the last stage's backward runs the loss
    assert ctrl[0, 0, :5].tolist() == [FWD, 0, 0, -1, -1]  # stage 0 reads the stack's input
    for s in range(1, 4):  # every other stage's F reads a buffer written at or before it
        for t in range(22):
            if code[t, s] == FWD:
                buffer = ctrl[t, s, 3]
                written = [u for u in range(t + 1) if ctrl[u, s, 5] == buffer]
                assert written and 0 <= buffer < inputs
    assert set(chunk.ravel().tolist()) == {0} and sorted(set(mb.ravel().tolist())) == list(range(8))


def test_zero_bubble_splits_the_backward_into_input_and_weight_slots():
    ctrl, _, _ = control("zero_bubble", 4, 8, 1)
    assert ctrl.shape[0] == 27  # 3 m + p - 1
    assert ((ctrl[..., 0] == WGT).sum(axis=0) == [8, 8, 8, 0]).all()  # last stage: W with tail
