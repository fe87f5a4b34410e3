"""Pipeline schedule tables: every schedule's bubble read off its slots equals its formula."""

from __future__ import annotations

import pytest

from loomax.pipeline_schedules import Action, formula, orders, table


@pytest.mark.parametrize(
    ("name", "v"),
    [("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)],
)
@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 8), (4, 4), (8, 16)])
def test_bubble_of_the_table_equals_the_formula(name, v, p, m):
    assert table(name, p, m, v).bubble == pytest.approx(formula(name, p, m, v))


def test_1f1b_with_4_stages_and_8_microbatches_idles_3_of_11():
    one_f_one_b = table("1f1b", 4, 8)
    assert one_f_one_b.bubble == pytest.approx(3 / 11)
    assert len(one_f_one_b.slots) == 33  # (m + p - 1) x (F + B), F one slot, B two
    assert table("zero_bubble", 4, 8).bubble < table("interleaved_1f1b", 4, 8, 2).bubble < 3 / 11


def test_1f1b_holds_at_most_p_microbatches_gpipe_all_of_them():
    assert table("gpipe", 4, 8).peak_in_flight == 8
    assert table("1f1b", 4, 8).peak_in_flight == 4
    assert table("zero_bubble", 4, 8).peak_in_flight == 4


def test_every_action_runs_once_after_its_inputs():
    t = table("interleaved_1f1b", 4, 8, 2)
    started: dict[tuple[Action, int], int] = {}
    for slot, row in enumerate(t.slots):
        for stage, action in enumerate(row):
            if action is not None:
                started.setdefault((action, stage), slot)
    assert len(started) == 2 * 4 * 8 * 2  # F and B of each microbatch's chunk on each stage
    # the first stage's first B comes after the last stage's F of that microbatch's last chunk
    assert t.slots[0][0] == Action("F", 0, 0)
    first_b = min(slot for slot, row in enumerate(t.slots) if row[0] and row[0].kind == "B")
    last_f = min(slot for slot, row in enumerate(t.slots) if row[3] == Action("F", 0, 1))
    assert first_b > last_f


def test_bad_schedules_are_named():
    with pytest.raises(ValueError, match="must be one of"):
        orders("dualpipe", 4, 8)
    with pytest.raises(ValueError, match="multiple of 4"):
        orders("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="one chunk per stage"):
        orders("1f1b", 4, 8, 2)
