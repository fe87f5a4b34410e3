"""Optimizer state offloaded to pinned host memory (``trainer.offload_optimizer_state``)."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from loomax.checkpoint import CheckpointerConfig


def run(tiny, path, steps=3, **settings):
    trainer = tiny.trainer(path, steps=steps, **settings)
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    state = tiny.init(trainer)
    final = trainer.train(state, itertools.islice(tiny.batches(), int(state.step), None)).state
    return losses, final


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_offloaded_state_rests_on_the_host_and_trains_identically(tiny, tmp_path):
    base_losses, base = run(tiny, tmp_path / "base")
    losses, final = run(
        tiny, tmp_path / "off", offload_optimizer_state=True,
        checkpointer=CheckpointerConfig(fixed_steps=[2]),
    )  # fmt: skip
    assert {x.sharding.memory_kind for x in jax.tree.leaves(final.opt_state)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(final.model)} == {"device"}
    assert losses == base_losses  # the same program, but for where the state waits
    for a, b in zip(leaves(final), leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)

    # resumed from step 2 into host memory, the last step is the same
    path = tmp_path / "off" / "run" / "checkpoints" / "step-2"
    resumed_losses, resumed = run(
        tiny, tmp_path / "resumed", offload_optimizer_state=True, load_checkpoint_path=str(path)
    )
    assert resumed_losses == losses[2:]
    assert {x.sharding.memory_kind for x in jax.tree.leaves(resumed.opt_state)} == {"pinned_host"}
    for a, b in zip(leaves(resumed), leaves(final), strict=True):
        np.testing.assert_array_equal(a, b)


def test_update_on_the_host_trains_identically(tiny, tmp_path):
    """``offload_optimizer_update``: the update runs where the state rests (XLA host compute)."""
    base_losses, base = run(tiny, tmp_path / "base")
    settings = {"offload_optimizer_state": True, "offload_optimizer_update": True}
    losses, final = run(tiny, tmp_path / "host", **settings)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(final.opt_state)} == {"pinned_host"}
    assert losses == base_losses
    for a, b in zip(leaves(final), leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)


def test_offload_and_diloco_are_refused_together():
    from loomax.train import TrainerConfig
    from loomax.train.diloco import DiLoCoConfig

    with pytest.raises(
        ValueError, match="trainer.offload_optimizer_state: not with trainer.diloco"
    ):
        TrainerConfig(offload_optimizer_state=True, diloco=DiLoCoConfig())
    with pytest.raises(ValueError, match="trainer.offload_optimizer_update: needs trainer.offload"):
        TrainerConfig(offload_optimizer_update=True)


def test_loomax_compile_shows_the_device_memory_the_host_update_saves(libtpu):
    """Compiled for v5e:2x2 (libtpu), the Adam moments rest in host memory and, with the update
    on the host, the device total drops by at least their size (the CPU backend has no memory
    spaces to tell apart: this is where the saving is checked)."""
    from loomax.config import parse_config
    from loomax.lm.config import TrainLmConfig
    from loomax.plan.compile import compile_run
    from loomax.plan.topology import get_topology

    args = [
        "--model.type", "gpt2", "--model.hidden_dim", "64", "--model.num_heads", "4",
        "--model.seq_len", "64", "--model.num_layers", "2", "--model.vocab_size", "512",
        "--trainer.train_batch_size", "8",
    ]  # fmt: skip
    offload = ["--trainer.offload_optimizer_state", "true"]
    offload += ["--trainer.offload_optimizer_update", "true"]
    topology = get_topology("v5e:2x2")
    base = compile_run(parse_config(TrainLmConfig, None, args), topology)
    off = compile_run(parse_config(TrainLmConfig, None, args + offload), topology)
    assert base.error is None and off.error is None
    moments = 2 * base.state_bytes // 3  # params, mu, nu: equal sizes (plus a few scalars)
    assert off.host_bytes >= moments - 64
    assert abs(off.state_bytes - (base.state_bytes - moments)) <= 64  # only params on device
    assert base.total_bytes - off.total_bytes >= 0.9 * moments, (base.total_bytes, off.total_bytes)
