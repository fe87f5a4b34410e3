"""What a checkpoint of the loop holds: the state (less frozen arrays, if asked) and the
metadata a resume needs (data position, PRNG key, hook states, time spent, config, mesh)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from loomax.train.config import TrainerConfig
from loomax.train.state import TrainerState
from loomax.train.step import without_frozen


def checkpoint_payload(
    config: TrainerConfig,
    state: TrainerState,
    step: int,
    *,
    run_config: dict[str, Any] | None,
    hooks: dict[str, Any],
    train_seconds: float,
    mesh: dict[str, int],
) -> tuple[TrainerState, dict[str, Any]]:
    """The tree to save at ``step`` and its ``metadata.json`` entries."""
    metadata: dict[str, Any] = {
        "config": run_config,
        "data": {"batches_consumed": step},
        "rng_key": np.asarray(jax.device_get(state.key)).tolist(),
        "hooks": hooks,
        "train_seconds": train_seconds,
        "mesh": mesh,
    }
    if not config.batch_schedule.is_constant:
        metadata["data"]["sequences_consumed"] = config.batch_schedule.offset(step)
    if not config.checkpoint_frozen and config.freeze:
        model, left_out = without_frozen(state.model, config.freeze)
        state = dataclasses.replace(state, model=model)
        metadata["frozen_left_out"] = [f"model/{name}" for name in left_out]
    return state, metadata


def saves_at_start(config: TrainerConfig, step: int, resumed: bool) -> bool:
    """Whether ``checkpointer.save_at_start`` asks for a (pinned) checkpoint before the first
    step: on a fresh run, at step 0."""
    return config.checkpointer.save_at_start and step == 0 and not resumed
