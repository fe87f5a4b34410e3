"""Will the step fit: the compiled step's memory against the host's or devices', before step 1."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

from loomax.mesh import batch_sharding
from loomax.train import memory_fit
from loomax.train.memory_fit import StepMemoryError, check_step_fits


def test_the_step_is_checked_then_run_as_compiled_once(tiny, tmp_path, monkeypatch):
    trainer = tiny.trainer(tmp_path, steps=2)
    init = lambda key: tiny.model.build(tiny.vocab, key=key)  # noqa: E731
    state = trainer.abstract_state(init)  # shapes only: nothing allocated yet
    batch = jax.ShapeDtypeStruct(
        (4, tiny.model.seq_len), jnp.int32, sharding=batch_sharding(trainer.mesh, 2)
    )
    compiled = trainer.precompile(state, batch, **trainer.step_args(1))

    with monkeypatch.context() as patched:  # a host with 1000 bytes of RAM left
        patched.setattr(memory_fit, "host_available_bytes", lambda: 1000)
        with pytest.raises(StepMemoryError) as refused:
            check_step_fits(compiled, jax.local_devices())
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("the train step will not fit in memory: it needs 0.0")
    assert "this host has 0.00 GiB of RAM available" in message
    for knob in ("model.hidden_dim", "trainer.train_batch_size", "trainer.check_memory false"):
        assert knob in message

    need = check_step_fits(compiled, jax.local_devices())  # this host has room for it
    assert need is not None and need.state > 0 and need.total >= need.state
    batches = tiny.batches()
    short = next(batches)[:, :8]  # a warm-up's shorter batch first (seq_len_warmup), then full
    final = trainer.train(trainer.initial_state(init), [short, next(batches), next(batches)])
    assert final.step == 2
    # the short batch compiled its own program; the full one ran the program compiled ahead
    # of time: the full-length step compiled once
    assert [fn.jitted._cache_size() for fn in trainer._step_fns.values()] == [1]
    assert trainer.compilations() == 2 and trainer._precompiled


def test_each_device_is_checked_against_its_free_memory():
    stats = types.SimpleNamespace(
        argument_size_in_bytes=6 * 2**30,
        output_size_in_bytes=6 * 2**30,
        alias_size_in_bytes=6 * 2**30,
        temp_size_in_bytes=3 * 2**30,
        generated_code_size_in_bytes=0,
    )
    compiled = types.SimpleNamespace(memory_analysis=lambda: stats)

    def gpu(free_gib):
        limit = 16 * 2**30
        return types.SimpleNamespace(
            platform="gpu",
            memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": limit - free_gib * 2**30},
            __str__=lambda self: "cuda:0",
        )

    assert check_step_fits(compiled, [gpu(10), gpu(12)]).total == 9 * 2**30
    with pytest.raises(StepMemoryError, match=r"needs 9.00 GiB per device .* has 8.00 GiB free"):
        check_step_fits(compiled, [gpu(10), gpu(8)])
