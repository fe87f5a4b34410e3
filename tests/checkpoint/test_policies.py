"""Checkpoint policies beyond `keep` and `save_interval`: fixed steps, step intervals, a
cooldown, the start checkpoint, keep_last and the removal strategies, synchronous saves."""

from __future__ import annotations

from datetime import timedelta

import jax.numpy as jnp
import pytest

from loomax.checkpoint import Checkpointer, CheckpointerConfig, KeepPolicy, list_checkpoints


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def tree(value: float):
    return {"w": jnp.full((4, 2), value, jnp.float32)}


def steps(path):
    return [c.step for c in list_checkpoints(str(path))]


def run(checkpointer: Checkpointer, last: int, clock: Clock | None = None, dt: float = 1.0):
    """Save whatever is due at steps 1..last (as the trainer does); returns the kinds saved."""
    saved = {}
    for step in range(1, last + 1):
        if clock is not None:
            clock.now += dt
        kind = checkpointer.due(step)
        if kind:
            checkpointer.save(step, tree(step), {}, permanent=kind == "permanent", block=True)
            saved[step] = kind
    return saved


NEVER = [KeepPolicy(every=10**9)]


def test_fixed_steps_are_permanent_and_pinned(tmp_path):
    config = CheckpointerConfig(keep=NEVER, save_interval=None, fixed_steps=[3, 7])
    ckpt = Checkpointer(config, str(tmp_path))
    assert run(ckpt, 8) == {3: "permanent", 7: "permanent"}
    assert all(c.pinned and c.permanent for c in list_checkpoints(str(tmp_path)))


def test_temporary_checkpoints_every_n_steps(tmp_path):
    config = CheckpointerConfig(
        keep=[KeepPolicy(every=10)], save_interval=None, save_interval_steps=3
    )
    ckpt = Checkpointer(config, str(tmp_path))
    saved = run(ckpt, 10)
    assert saved == {3: "temporary", 6: "temporary", 9: "temporary", 10: "permanent"}
    assert steps(tmp_path) == [10]  # each temporary one went once a newer one committed


def test_cooldown_between_temporary_saves(tmp_path):
    clock = Clock()
    config = CheckpointerConfig(
        keep=NEVER,
        save_interval=None,
        save_interval_steps=1,
        temporary_cooldown=timedelta(seconds=2.5),
        removal="never",
    )
    ckpt = Checkpointer(config, str(tmp_path), clock=clock)
    # a step a second, a temporary save due every step, at most one per 2.5 s
    assert list(run(ckpt, 9, clock)) == [3, 6, 9]


def test_keep_last_temporary_checkpoints(tmp_path):
    config = CheckpointerConfig(keep=NEVER, save_interval=None, save_interval_steps=1, keep_last=3)
    ckpt = Checkpointer(config, str(tmp_path))
    run(ckpt, 6)
    assert steps(tmp_path) == [4, 5, 6]


def test_removal_never_keeps_everything(tmp_path):
    config = CheckpointerConfig(
        keep=NEVER, save_interval=None, save_interval_steps=2, removal="never"
    )
    run(Checkpointer(config, str(tmp_path)), 6)
    assert steps(tmp_path) == [2, 4, 6]


def test_all_non_permanent_prunes_policy_checkpoints_but_not_pinned_ones(tmp_path):
    config = CheckpointerConfig(
        keep=[KeepPolicy(every=2)],
        save_interval=None,
        fixed_steps=[1],
        removal="all_non_permanent",
        keep_last=2,
    )
    ckpt = Checkpointer(config, str(tmp_path))
    run(ckpt, 10)
    assert steps(tmp_path) == [1, 8, 10]
    # ephemeral_only (the default) never touches them
    other = tmp_path / "default"
    run(
        Checkpointer(
            CheckpointerConfig(keep=[KeepPolicy(every=2)], save_interval=None), str(other)
        ),
        6,
    )
    assert steps(other) == [2, 4, 6]


def test_checkpoints_of_an_earlier_attempt_count_for_keep_last(tmp_path):
    config = CheckpointerConfig(
        keep=[KeepPolicy(every=2)], save_interval=None, removal="all_non_permanent", keep_last=2
    )
    run(Checkpointer(config, str(tmp_path)), 4)  # steps 2, 4
    resumed = Checkpointer(config, str(tmp_path))
    resumed.adopt(list_checkpoints(str(tmp_path)), 4)
    for step in (6, 8):
        resumed.save(step, tree(step), {}, permanent=True, block=True)
    assert steps(tmp_path) == [6, 8]


def test_synchronous_saves(tmp_path):
    ckpt = Checkpointer(CheckpointerConfig(async_save=False), str(tmp_path))
    ckpt.save(1, tree(1.0), {}, permanent=True)
    assert ckpt._thread is None and steps(tmp_path) == [1]  # committed before save returned


def test_metadata_records_run_and_pinning(tmp_path):
    ckpt = Checkpointer(CheckpointerConfig(), str(tmp_path), run_id="r7")
    ckpt.save(0, tree(0.0), {}, permanent=True, pinned=True, block=True)
    (info,) = list_checkpoints(str(tmp_path))
    assert info.run_id == "r7" and info.pinned


def test_append_run_id_to_base_path(tmp_path):
    config = CheckpointerConfig(append_run_id_to_base_path=True)
    ckpt = Checkpointer(config, str(tmp_path), run_id="r1")
    assert ckpt.directory.url.endswith("/r1")
    with pytest.raises(ValueError, match="append_run_id_to_base_path needs a run id"):
        Checkpointer(config, str(tmp_path))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"save_interval_steps": 0}, "save_interval_steps must be > 0"),
        ({"fixed_steps": [3, -1]}, r"fixed_steps must be steps >= 0, got \[-1\]"),
        ({"keep_last": 0}, "keep_last must be >= 1"),
        ({"removal": "sometimes"}, "removal must be one of"),
        ({"removal": "all_non_permanent"}, "removal all_non_permanent needs keep_last"),
        ({"temporary_cooldown": timedelta(0)}, "temporary_cooldown must be positive"),
    ],
)
def test_bad_settings_name_the_key(settings, message):
    with pytest.raises(ValueError, match=f"trainer.checkpointer.{message}"):
        CheckpointerConfig(**settings)
