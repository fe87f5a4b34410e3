"""Warmup then constant/linear/cosine decay, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest

from loomax.optim.schedule import steps_of, warmup_then_decay


def values(kind, steps=110, warmup=10, ratio=0.1, peak=1.0, at=(0, 4, 9, 10, 60, 110, 200)):
    schedule = warmup_then_decay(kind, peak, steps, warmup, ratio)
    return [float(schedule(s)) for s in at]


def test_warmup_is_linear_to_peak():
    for kind in ("constant", "linear", "cosine"):
        v = values(kind)
        assert v[:3] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine_by_hand():
    v = values("cosine")
    assert v[3] == pytest.approx(1.0)
    assert v[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert v[5] == pytest.approx(0.1) and v[6] == pytest.approx(0.1)


def test_linear_and_constant_by_hand():
    lin = values("linear")
    assert lin[4] == pytest.approx(1.0 - 0.9 * 0.5) and lin[5] == pytest.approx(0.1)
    assert values("constant")[3:] == pytest.approx([1.0] * 4)


def test_warmup_as_fraction():
    assert (
        steps_of(0.1, 200, "w") == 20
        and steps_of(0, 200, "w") == 0
        and steps_of(30, 200, "w") == 30
    )
    with pytest.raises(ValueError, match="optimizer.warmup"):
        steps_of(2.5, 200, "optimizer.warmup")
    schedule = warmup_then_decay("cosine", 2.0, 100, 0.0, 0.0)
    assert float(schedule(0)) == pytest.approx(2.0) and float(schedule(100)) == pytest.approx(0.0)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="lr_schedule"):
        warmup_then_decay("exp", 1.0, 10, 0, 0)
