"""The grouped matmul: the blocked CPU form against a dense per-group loop and against
``jax.lax.ragged_dot`` (values and gradients, empty experts, uneven groups, rows past the
groups), the megablox kernel interpreted on CPU, and the blocked form's cost: FLOPs of the
routed rows plus padding, not of every expert times every row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.models.grouped_matmul import blocked_grouped_matmul, grouped_matmul, resolve

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
