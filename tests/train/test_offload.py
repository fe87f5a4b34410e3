"""Optimizer state offloaded to pinned host memory (``trainer.offload_optimizer_state``)."""

from __future__ import annotations

import dataclasses
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


@pytest.fixture(scope="module")
def baseline(tiny, tmp_path_factory):
    """The losses and final state of 3 steps without any offload (the tests' reference)."""
    return run(tiny, tmp_path_factory.mktemp("base"))


def test_offloaded_state_rests_on_the_host_and_trains_identically(tiny, tmp_path, baseline):
    base_losses, base = baseline
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


def test_update_on_the_host_trains_identically(tiny, tmp_path, baseline):
    """``offload_optimizer_update``: the update runs where the state rests (XLA host compute)."""
    base_losses, base = baseline
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
    with pytest.raises(ValueError, match="trainer.offload_params: not with trainer.diloco"):
        TrainerConfig(offload_params=True, diloco=DiLoCoConfig())


def test_offloaded_params_need_the_scanned_stack(tiny, tmp_path):
    from loomax.config import ConfigError

    trainer = tiny.trainer(tmp_path, steps=1, offload_params=True)
    unrolled = dataclasses.replace(tiny.model, scan_layers=False)
    state = trainer.initial_state(lambda key: unrolled.build(tiny.vocab, key=key))
    with pytest.raises(ConfigError, match="trainer.offload_params: needs model.scan_layers true"):
        trainer.train(state, tiny.batches())


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


def on_host(final):
    """Memory kinds of the model's arrays, split by whether they have a ``layers`` axis."""
    import equinox as eqx
    import haliax as hax

    kinds: dict[bool, set[str]] = {True: set(), False: set()}
    named = lambda x: isinstance(x, hax.NamedArray)  # noqa: E731
    for x in jax.tree.leaves(eqx.filter(final.model, eqx.is_array), is_leaf=named):
        stacked = isinstance(x, hax.NamedArray) and "layers" in {a.name for a in x.axes}
        kinds[stacked].update(a.sharding.memory_kind for a in jax.tree.leaves(x))
    return kinds


@pytest.mark.parametrize("on_the_host", [False, True], ids=["streamed", "host-update"])
def test_offloaded_params_train_identically_and_resume(tiny, tmp_path, on_the_host, baseline):
    """``offload_params``: the stacked layers rest in host memory and each is fetched inside
    the layer scan; losses and the final state are those of the run without it, bit for bit,
    also across a resume (the embeddings and the final norm stay on the devices)."""
    base_losses, base = baseline
    settings = {"offload_params": True}
    if on_the_host:
        settings |= {"offload_optimizer_state": True, "offload_optimizer_update": True}
    saving = CheckpointerConfig(fixed_steps=[2])
    losses, final = run(tiny, tmp_path / "off", checkpointer=saving, **settings)
    assert on_host(final) == {True: {"pinned_host"}, False: {"device"}}
    assert losses == base_losses
    for a, b in zip(leaves(final), leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)

    path = tmp_path / "off" / "run" / "checkpoints" / "step-2"
    resumed_losses, resumed = run(
        tiny, tmp_path / "resumed", load_checkpoint_path=str(path), **settings
    )
    assert resumed_losses == losses[2:]
    assert on_host(resumed) == {True: {"pinned_host"}, False: {"device"}}
    for a, b in zip(leaves(resumed), leaves(final), strict=True):
        np.testing.assert_array_equal(a, b)


def test_loomax_compile_shows_the_device_memory_offloaded_params_save(libtpu):
    """Compiled for one v5e chip (libtpu), with the optimizer state and its update on the host
    in both programs: with ``offload_params`` the stacked layers' parameters rest in host
    memory too, and the device total drops by more than their size (their gradients and
    updates stay on the host as well). The CPU backend has one memory: this is where the
    saving is checked."""
    from loomax.config import parse_config
    from loomax.lm.config import TrainLmConfig
    from loomax.plan.compile import compile_run
    from loomax.plan.topology import get_topology

    args = [
        "--model.type", "gpt2", "--model.hidden_dim", "128", "--model.num_heads", "4",
        "--model.seq_len", "32", "--model.num_layers", "2", "--model.vocab_size", "256",
        "--trainer.train_batch_size", "4",
        "--trainer.offload_optimizer_state", "true", "--trainer.offload_optimizer_update", "true",
    ]  # fmt: skip
    topology = get_topology("v5e:1x1")
    base = compile_run(parse_config(TrainLmConfig, None, args), topology)
    off = compile_run(
        parse_config(TrainLmConfig, None, [*args, "--trainer.offload_params", "true"]), topology
    )
    assert base.error is None and off.error is None
    # per block: qkv, out and the MLP's two matrices (12 x 128^2), 13 x 128 biases and norms
    layers = 2 * (12 * 128 * 128 + 13 * 128) * 4
    assert base.state_bytes - off.state_bytes == layers
    assert off.host_bytes - base.host_bytes >= layers
    assert base.total_bytes - off.total_bytes >= layers, (base.total_bytes, off.total_bytes)


def test_offloaded_params_with_microbatches_and_frozen_layers(tiny, tmp_path):
    """Two microbatches (their gradients accumulated on the devices) and a frozen part of the
    stack (it stays in host memory, untouched): still the losses and state of the plain run."""
    settings = {"per_device_parallelism": 2, "freeze": ["attn"]}
    base_losses, base = run(tiny, tmp_path / "base", **settings)
    host = {"offload_optimizer_state": True, "offload_optimizer_update": True}
    losses, final = run(tiny, tmp_path / "off", offload_params=True, **host, **settings)
    assert losses == base_losses
    for a, b in zip(leaves(final), leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)


def test_consumers_of_an_offloaded_model_see_the_same_model(tiny, tmp_path):
    """EMA weights and activation statistics in the step, and, from the host-resident final
    model, sampling (whose decoding loop fetches each layer) and the Hugging Face tensors:
    as without ``offload_params``."""
    from loomax.hf.convert import hf_state
    from loomax.hooks import ActivationStatsHook, EmaHook
    from loomax.models.decoding.generate import sample_tokens

    def consumers(path, **settings):
        trainer = tiny.trainer(path, steps=2, **settings)
        trainer.add_hook(EmaHook(decay=0.5, use_for_eval=True))
        trainer.add_hook(ActivationStatsHook(every=1))  # one step program, not two
        stats: list = []
        trainer.add_hook(lambda info: stats.append(info.host_metrics()), every=2)
        final = trainer.train(tiny.init(trainer), tiny.batches()).state
        key = jax.random.PRNGKey(0)
        tokens = sample_tokens(final.model, [1, 2, 3], seq_len=16, max_new_tokens=4, key=key)
        return stats, leaves(final.extras), np.asarray(tokens), hf_state(final.model)[1]

    base = consumers(tmp_path / "base")
    host = {"offload_optimizer_state": True, "offload_optimizer_update": True}
    off = consumers(tmp_path / "off", offload_params=True, **host)
    assert off[0] == base[0] and any(k.startswith("activations/") for k in off[0][0])
    for a, b in zip(off[1], base[1], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(off[2], base[2])
    assert off[3].keys() == base[3].keys()
    for name, tensor in base[3].items():
        np.testing.assert_array_equal(np.asarray(off[3][name]), np.asarray(tensor))
