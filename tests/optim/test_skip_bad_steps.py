"""skip_bad_steps: a spiking loss or grad norm gives a zero update and keeps the inner state."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loomax.optim.skip_bad_steps import skip_bad_steps
from loomax.train.step import optimizer_state_metrics as skip_metrics


def run(losses, grads_scale, **kw):
    opt = skip_bad_steps(optax.adam(0.1), window=8, k=3.0, min_history=4, **kw)
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    out = []
    for loss, scale in zip(losses, grads_scale, strict=True):
        grads = {"w": jnp.full(3, scale, jnp.float32)}
        before = state
        updates, state = opt.update(grads, state, params, value=jnp.asarray(loss))
        out.append((float(jnp.abs(updates["w"]).sum()), before, state))
    return out


def test_loss_spike_is_skipped_and_state_kept():
    losses = [2.0, 2.1, 1.9, 2.0, 2.05, 50.0, 2.0]
    out = run(losses, [1.0] * len(losses))
    updates = [u for u, _, _ in out]
    assert updates[5] == 0.0 and all(u > 0 for i, u in enumerate(updates) if i != 5)
    _, before, after = out[5]
    np.testing.assert_array_equal(before.inner[0].mu["w"], after.inner[0].mu["w"])
    assert int(after.inner[0].count) == int(before.inner[0].count)
    metrics = skip_metrics(after)
    assert float(metrics["optim/skipped_step"]) == 1.0
    assert float(skip_metrics(out[6][2])["optim/skipped_step"]) == 0.0
    assert float(skip_metrics(out[6][2])["optim/skipped_steps_total"]) == 1.0


def test_grad_norm_spike_and_nan_are_skipped_not_early_spikes():
    scales = [1.0, 1.1, 0.9, 1.0, 1.0, 100.0, 1.0]
    out = run([2.0] * 7, scales)
    assert [u == 0.0 for u, _, _ in out] == [False] * 5 + [True, False]
    early = run([2.0, 80.0, 2.0], [1.0, 1.0, 1.0])  # below min_history: never skipped
    assert all(u > 0 for u, _, _ in early)
    nan = run([2.0, float("nan")], [1.0, 1.0])
    assert nan[1][0] == 0.0


def test_bad_arguments_name_the_setting():
    with pytest.raises(ValueError, match="window"):
        skip_bad_steps(optax.sgd(1.0), window=1)
    assert skip_metrics(optax.sgd(1.0).init({"w": jnp.ones(1)})) == {}
