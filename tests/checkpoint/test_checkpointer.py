"""Checkpointer: policies, atomic commit, temporary deletion, async copies, corrupt data."""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.checkpoint import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointError,
    KeepPolicy,
    list_checkpoints,
    load_latest,
)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def tree(value: float):
    return {"w": jnp.full((8, 4), value, jnp.float32), "b": jnp.arange(3, dtype=jnp.int32)}


def load(path, **kwargs):
    template = jax.eval_shape(lambda: tree(0.0))
    shardings = jax.tree.map(
        lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), template
    )
    return load_latest(str(path), template, shardings, **kwargs)


def steps(path):
    return [c.step for c in list_checkpoints(str(path))]


def test_keep_policies():
    config = CheckpointerConfig(keep=[KeepPolicy(every=5, until=20), KeepPolicy(every=50)])
    assert [s for s in range(1, 120) if config.is_permanent(s)] == [5, 10, 15, 20, 50, 100]
    with pytest.raises(
        ValueError, match=r"keep\[1\]: only the last keep policy may have until: null"
    ):
        CheckpointerConfig(keep=[KeepPolicy(every=5), KeepPolicy(every=10)])
    with pytest.raises(ValueError, match=r"keep\[1\].until \(10\) must be larger"):
        CheckpointerConfig(keep=[KeepPolicy(5, until=20), KeepPolicy(10, until=10)])
    with pytest.raises(ValueError, match=r"keep\[0\].every must be > 0"):
        CheckpointerConfig(keep=[KeepPolicy(every=0)])


def test_time_based_checkpoints_are_temporary(tmp_path):
    clock = Clock()
    config = CheckpointerConfig(save_interval=timedelta(seconds=10), keep=[KeepPolicy(every=4)])
    ckpt = Checkpointer(config, str(tmp_path), clock=clock)
    assert ckpt.due(1) is None
    clock.now = 11
    assert ckpt.due(1) == "temporary"
    ckpt.save(1, tree(1), {}, permanent=False)
    assert ckpt.due(2) is None  # the interval restarts at each save
    clock.now = 22
    ckpt.save(2, tree(2), {}, permanent=False, block=True)
    assert steps(tmp_path) == [2]  # step 1 was deleted once step 2 committed
    ckpt.save(4, tree(4), {}, permanent=ckpt.due(4) == "permanent", block=True)
    assert steps(tmp_path) == [4]  # a newer permanent one supersedes temporaries too
    clock.now = 40
    ckpt.save(5, tree(5), {}, permanent=False, block=True)
    assert steps(tmp_path) == [4, 5]  # permanent ones stay


@pytest.mark.parametrize("delete_old", [True, False])
def test_temporaries_of_an_earlier_attempt(tmp_path, delete_old):
    first = Checkpointer(CheckpointerConfig(), str(tmp_path))
    first.save(3, tree(3), {}, permanent=False, block=True)
    second = Checkpointer(CheckpointerConfig(delete_old_temp_checkpoints=delete_old), str(tmp_path))
    second.adopt(list_checkpoints(str(tmp_path)), resumed_step=3)
    assert second.due(3) is None and not second.save(3, tree(3), {}, permanent=True)
    second.save(6, tree(6), {}, permanent=True, block=True)
    assert steps(tmp_path) == ([6] if delete_old else [3, 6])


def test_an_incomplete_checkpoint_never_shadows_a_complete_one(tmp_path):
    ckpt = Checkpointer(CheckpointerConfig(), str(tmp_path))
    ckpt.save(10, tree(10), {"note": "kept"}, permanent=True, block=True)
    ckpt.save(20, tree(20), {}, permanent=True, block=True)
    os.remove(tmp_path / "step-20" / "metadata.json")  # as if killed before the commit
    (tmp_path / "step-30" / "w").mkdir(parents=True)  # a save that barely started
    assert steps(tmp_path) == [10]
    info, loaded, _ = load(tmp_path, fall_back=False)
    assert info.step == 10 and info.metadata["note"] == "kept"
    np.testing.assert_array_equal(loaded["w"], np.full((8, 4), 10.0))
    # saving step 20 again replaces the debris of the interrupted attempt
    again = Checkpointer(CheckpointerConfig(), str(tmp_path))
    again.save(20, tree(21), {}, permanent=True, block=True)
    assert steps(tmp_path) == [10, 20]
    np.testing.assert_array_equal(load(tmp_path, fall_back=False)[1]["w"], np.full((8, 4), 21.0))


def test_metadata_is_json_with_versions_and_manifest(tmp_path):
    ckpt = Checkpointer(CheckpointerConfig(), str(tmp_path))
    ckpt.save(1, tree(1), {"config": {"a": 1}}, permanent=True, block=True)
    meta = json.loads((tmp_path / "step-1" / "metadata.json").read_text())
    assert meta["step"] == 1 and meta["config"] == {"a": 1} and meta["permanent"] is True
    assert meta["arrays"]["w"] == {"shape": [8, 4], "dtype": "float32", "chunks": [8, 4]}
    assert {"jax", "tensorstore", "haliax"} <= set(meta["versions"])
    assert "saved_at" in meta and meta["process_count"] == 1


def test_save_copies_the_arrays_before_returning(tmp_path):
    ckpt = Checkpointer(CheckpointerConfig(), str(tmp_path))
    state = tree(7)
    ckpt.save(1, state, {}, permanent=True)
    for leaf in jax.tree.leaves(state):
        leaf.delete()  # what donating the state to the next step does
    ckpt.wait()
    np.testing.assert_array_equal(load(tmp_path, fall_back=False)[1]["w"], np.full((8, 4), 7.0))


def test_a_donating_step_after_save_does_not_change_what_is_saved(tmp_path):
    ckpt = Checkpointer(CheckpointerConfig(), str(tmp_path))
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 3 + 1, t), donate_argnums=0)
    state = tree(2)
    ckpt.save(1, state, {}, permanent=True)
    for _ in range(3):  # training goes on while the write is in flight
        state = step(state)
    ckpt.wait()
    np.testing.assert_array_equal(load(tmp_path, fall_back=False)[1]["w"], np.full((8, 4), 2.0))
    np.testing.assert_array_equal(state["w"], np.full((8, 4), 67.0))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_corrupt_array_data_names_checkpoint_and_array(tmp_path, damage, caplog):
    ckpt = Checkpointer(CheckpointerConfig(), str(tmp_path))
    ckpt.save(1, tree(1), {}, permanent=True, block=True)
    ckpt.save(2, tree(2), {}, permanent=True, block=True)
    chunk = tmp_path / "step-2" / "w" / "c" / "0" / "0"
    if damage == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:-10])
    else:
        chunk.unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint .*step-2: array 'w'"):
        load(tmp_path, fall_back=False)
    with caplog.at_level(logging.WARNING):
        info, loaded, _ = load(tmp_path, fall_back=True)
    assert info.step == 1
    np.testing.assert_array_equal(loaded["w"], np.full((8, 4), 1.0))
    assert "step-2: array 'w'" in caplog.text and "falling back" in caplog.text


def test_unwritable_base_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    ckpt = Checkpointer(CheckpointerConfig(), str(blocker / "checkpoints"))
    with pytest.raises(
        ValueError, match=r"trainer.checkpointer.base_path: cannot write to .*a-file/checkpoints"
    ):
        ckpt.check_writable()


def test_background_errors_surface_on_the_next_call(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    ckpt = Checkpointer(CheckpointerConfig(), str(blocker))
    ckpt.save(1, tree(1), {}, permanent=True)  # the write fails on the background thread
    with pytest.raises((OSError, ValueError)):
        ckpt.wait()
    ckpt.wait()  # reported once


# ---------------------------------------------------------------- policies beyond keep and save_interval
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
