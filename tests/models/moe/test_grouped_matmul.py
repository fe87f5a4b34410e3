"""The grouped matmul: the blocked CPU form against a dense per-group loop and against
``jax.lax.ragged_dot`` (values and gradients, empty experts, uneven groups, rows past the
groups), the megablox kernel interpreted on CPU, and the blocked form's cost: FLOPs of the
routed rows plus padding, not of every expert times every row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.models.moe import grouped_matmul as gm
from loomax.models.moe.grouped_matmul import (
    blocked_grouped_matmul,
    grouped_matmul,
    grouped_matmul_grads,
    resolve,
)

SIZES = {
    "uneven": [10, 0, 3, 20, 4],  # an empty expert, groups not multiples of the block
    "one-group": [37, 0, 0, 0, 0],
    "short": [5, 0, 9, 2, 0],  # rows past sum(group_sizes) come out as zeros
}


def operands(sizes, m=37, k=16, n=24, seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(k1, (m, k), jnp.float32)
    w = jax.random.normal(k2, (len(sizes), k, n), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32)


def dense_reference(x, w, sizes):
    """Each group's rows times its matrix, in float64; rows past the groups zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, size in enumerate(np.asarray(sizes)):
        out[start : start + size] = x[start : start + size] @ w[g]
        start += size
    return out


@pytest.mark.parametrize("case", SIZES)
@pytest.mark.parametrize("block", [1, 4, 8, 64])
def test_blocked_equals_the_dense_reference_and_ragged_dot(case, block):
    x, w, sizes = operands(SIZES[case])
    got = jax.jit(blocked_grouped_matmul, static_argnums=3)(x, w, sizes, block)
    np.testing.assert_allclose(got, dense_reference(x, w, sizes), rtol=1e-6, atol=1e-5)
    want = jax.lax.ragged_dot(x, w, sizes)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["uneven", "short"])
def test_blocked_gradients_equal_ragged_dot(case):
    x, w, sizes = operands(SIZES[case])
    cot = jax.random.normal(jax.random.PRNGKey(9), (x.shape[0], w.shape[2]))

    def loss(fn):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w) * cot), argnums=(0, 1)))

    gx, gw = loss(lambda x, w: blocked_grouped_matmul(x, w, sizes, 4))(x, w)
    rx, rw = loss(lambda x, w: jax.lax.ragged_dot(x, w, sizes))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-6, atol=1e-5)
    assert np.all(np.asarray(gw[1]) == 0)  # the empty expert gets no gradient


def test_megablox_kernel_interpreted_equals_ragged_dot():
    x, w, sizes = operands([100, 0, 50, 30, 5], m=200, k=128, n=128)
    got = grouped_matmul(x, w, sizes, impl="megablox")
    np.testing.assert_allclose(got, jax.lax.ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-4)


def test_auto_is_blocked_on_cpu_and_names_are_checked():
    assert resolve("auto") == "blocked"
    assert resolve("ragged_dot") == "ragged_dot"
    with pytest.raises(ValueError, match="grouped matmul must be one of"):
        resolve("dense")


def flops(fn, *args) -> float:
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def test_blocked_does_the_routed_work_not_every_expert_times_every_row():
    m, k, n, block = 512, 32, 32, 8
    for groups in (4, 64):
        sizes = jnp.full((groups,), m // groups, jnp.int32)
        x, w = jnp.ones((m, k)), jnp.ones((groups, k, n))
        blocked = flops(lambda x, w, s: blocked_grouped_matmul(x, w, s, block), x, w, sizes)
        ragged = flops(lambda x, w, s: jax.lax.ragged_dot(x, w, s), x, w, sizes)
        routed = 2 * m * k * n
        # at most one padded block per group beyond the routed rows (+ a little elementwise)
        assert routed <= blocked <= 1.1 * 2 * (m + groups * block) * k * n, (groups, blocked)
        assert ragged >= groups * routed  # XLA:CPU's ragged_dot: every expert, every row


@pytest.mark.parametrize("case", SIZES)
def test_blocked_loop_over_several_steps_equals_ragged_dot(case, monkeypatch):
    """Two tiles a loop step (the weights' budget made tiny): values and both gradients."""
    x, w, sizes = operands(SIZES[case])
    monkeypatch.setattr(gm, "WEIGHT_BYTES_PER_STEP", 2 * 16 * 24 * 4)
    assert gm.tiles_per_step(37, 16, 24, 5, 4, 4) == 2
    cot = jax.random.normal(jax.random.PRNGKey(9), (x.shape[0], w.shape[2]))

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w) * cot), argnums=(0, 1)))

    (got, (gx, gw)) = loss(lambda x, w: blocked_grouped_matmul(x, w, sizes, 4))(x, w)
    (want, (rx, rw)) = loss(lambda x, w: jax.lax.ragged_dot(x, w, sizes))(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(gx, rx, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-6, atol=1e-5)
    dx, dw = grouped_matmul_grads(x, w, sizes, cot, impl="blocked", block=4)
    np.testing.assert_allclose(dx, rx, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(dw, rw, rtol=1e-6, atol=1e-5)


def test_blocked_loop_runs_the_occupied_tiles_only():
    """A receive buffer 16x its routed rows: the loop's steps follow the routed rows."""
    block, chunk = 8, 2
    routed = jnp.asarray([9, 0, 16, 3], jnp.int32)  # tiles: 2 + 0 + 2 + 1 = 5
    for m in (28, 16 * 28):
        layout = gm.tile_layout(routed, m, block, chunk)
        assert int(layout.trips) == 3  # ceil(5 / 2), whatever m
        assert layout.steps == -(-(-(-m // block) + 4) // chunk)
    assert gm.expected_trips(28, 16 * 28, 4, block, chunk) == 3  # (28 + 16) / 8 tiles


def test_blocked_memory_follows_a_loop_step_not_the_tiles(monkeypatch):
    """The compiled value-and-gradient of a 4,096-row buffer over 64 experts holds one
    step's gathered weights and one [G, k, n] weight gradient, not one copy per tile."""
    m, k, n, groups, block = 4096, 64, 64, 64, 8
    monkeypatch.setattr(gm, "WEIGHT_BYTES_PER_STEP", 4 * k * n * 4)  # 4 tiles a step
    x, w = jnp.ones((m, k)), jnp.ones((groups, k, n))
    sizes = jnp.full((groups,), 4, jnp.int32)  # 256 routed rows of 4,096

    def step(x, w):
        return jax.grad(lambda x, w: jnp.sum(blocked_grouped_matmul(x, w, sizes, block)), (0, 1))(
            x, w
        )

    temp = jax.jit(step).lower(x, w).compile().memory_analysis().temp_size_in_bytes
    per_tile_copies = (-(-m // block) + groups) * k * n * 4  # 9.4 MB: what the old form held
    assert temp < 2 * groups * k * n * 4 < per_tile_copies, temp  # 0.12 MB (old form: 13 MB)


def test_megablox_gradients_with_unequal_widths_equal_ragged_dot():
    """dx = dy @ w^T contracts over n and yields k columns: its tiles are (rows, n, k), not
    the forward's (rows, k, n) (a [.., 128, 96] expert failed to lower for a TPU)."""
    x, w, sizes = operands([60, 0, 40, 28], m=128, k=128, n=96)
    dy = jax.random.normal(jax.random.PRNGKey(3), (128, 96))
    dx, dw = grouped_matmul_grads(x, w, sizes, dy, impl="megablox")
    _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
    rx, rw = vjp(dy)
    np.testing.assert_allclose(dx, rx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw, rw, rtol=1e-5, atol=1e-4)


def test_auto_takes_megablox_only_where_its_tiles_fit():
    assert gm.megablox_fits((16, 128, 96)) and gm.megablox_fits((8, 256, 384))
    assert not gm.megablox_fits((16, 192, 128))  # above one tile, not a multiple of it
    assert gm.resolve("megablox", (2, 192, 128)) == "megablox"  # asked for by name: its error
