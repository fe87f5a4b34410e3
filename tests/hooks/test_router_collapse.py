"""Routing-collapse warning: a layer whose least-used expert stays near zero load for
``patience`` finished steps is named once, counted while collapsed, and forgiven on recovery."""

from __future__ import annotations

import logging

import pytest

from loomax.hooks import RouterCollapseHook
from loomax.train import StepInfo
from loomax.train.hooks import CompletedStep


def run(hook, loads_by_step, caplog):
    """Feed each step's ``{layer: load_min}``; returns the last StepInfo."""
    info = None
    for step, loads in enumerate(loads_by_step, 1):
        metrics = {"train/loss": 1.0, **{f"moe/{k}/load_min": v for k, v in loads.items()}}
        info = StepInfo(step + 1, None, {}, previous=CompletedStep(step, metrics, 0.1, 0))
        hook.on_step(info)
    return info


def test_a_layer_stuck_near_zero_is_named_once_and_counted(caplog):
    hook = RouterCollapseHook(threshold=0.05, patience=3, every=1)
    steps = [{"layer_0": 0.9, "layer_1": 0.01}] * 5
    with caplog.at_level(logging.WARNING):
        info = run(hook, steps, caplog)
    warnings = [r.getMessage() for r in caplog.records if "routing collapse" in r.getMessage()]
    assert len(warnings) == 1 and "layer_1" in warnings[0] and "layer_0" not in warnings[0]
    assert info.record == {"moe/collapsed_layers": 1}
    again = RouterCollapseHook(threshold=0.05, patience=3)
    again.load_state_dict(hook.state_dict())
    assert again.collapsed == ["layer_1"]


def test_recovery_resets_and_dense_models_are_left_alone(caplog):
    hook = RouterCollapseHook(threshold=0.05, patience=3, every=1)
    steps = [{"layer_0": 0.0}, {"layer_0": 0.0}, {"layer_0": 0.5}] * 3  # never 3 in a row
    with caplog.at_level(logging.WARNING):
        info = run(hook, steps, caplog)
    assert not [r for r in caplog.records if "routing collapse" in r.getMessage()]
    assert info.record == {"moe/collapsed_layers": 0}
    dense = RouterCollapseHook(patience=1, every=1)
    assert run(dense, [{}] * 3, caplog).record == {}  # no moe/ metrics: nothing logged
    with pytest.raises(ValueError, match="patience"):
        RouterCollapseHook(patience=0)
