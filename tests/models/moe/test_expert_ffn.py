"""`expert_ffn`: the experts' gated MLP over a receive buffer, its backward on the kept rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_policies

from loomax.config import ConfigError
from loomax.models import MixtralConfig
from loomax.models.moe.expert_ffn import expert_ffn
from loomax.models.moe.grouped_matmul import grouped_matmul, grouped_matmul_grads
from loomax.models.moe.moe import MoeConfig
from loomax.plan.flops import count_step

ROWS, EMBED, MLP = 256, 16, 24
SIZES = jnp.array([70, 50])  # 120 routed rows of the 256-row buffer, two local experts
ROUTED = 120


def inputs():
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(keys[0], (ROWS, EMBED))
    x = x.at[ROUTED:].set(jnp.nan)  # rows past the groups: never read
    gate, up = (jax.random.normal(k, (2, EMBED, MLP)) / 4 for k in keys[1:3])
    down = jax.random.normal(keys[3], (2, MLP, EMBED)) / 4
    weights = jax.random.normal(keys[4], (ROUTED, EMBED))
    return x, gate, up, down, weights


def ffn(impl: str, keep: int):
    mm = lambda a, w, s: grouped_matmul(a, w, s, impl=impl, block=8, zero_rest=False)  # noqa: E731
    mm_grads = lambda a, w, s, dy: grouped_matmul_grads(a, w, s, dy, impl=impl, block=8)  # noqa: E731
    return lambda x, g, u, d: expert_ffn(
        x, SIZES, g, u, d, mm=mm, mm_grads=mm_grads, glu=_swiglu, keep=keep
    )


def _swiglu(g, u):
    return jax.nn.silu(g) * u


def reference(x, gate, up, down):
    """The same MLP by plain autodiff of ragged_dot, on the routed rows alone."""
    x = x[:ROUTED]
    mm = lambda a, w: grouped_matmul(a, w, SIZES, impl="ragged_dot")  # noqa: E731
    return mm(jax.nn.silu(mm(x, gate)) * mm(x, up), down)


def value_and_grads(fn, x, gate, up, down, weights):
    loss = lambda *args: jnp.sum(fn(*args)[:ROUTED] * weights)  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, gate, up, down)
    return value, (grads[0][:ROUTED], *grads[1:])


@pytest.mark.parametrize("impl", ["blocked", "megablox"])
@pytest.mark.parametrize("keep", [128, 64, ROWS])  # fits / a device holds more / whole buffer
def test_backward_from_kept_rows_or_recomputed_equals_autodiff(impl, keep):
    x, gate, up, down, weights = inputs()
    want = value_and_grads(reference, x, gate, up, down, weights)
    got = value_and_grads(ffn(impl, keep), x, gate, up, down, weights)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(b))))


def kernel_calls(saved: bool, keep: int):
    """Grouped-matmul kernels (megablox, interpreted here) in the gradient of a remat'd layer
    that keeps `moe_up` or nothing, and the fallbacks the count left out."""
    x, gate, up, down, weights = inputs()
    policy = checkpoint_policies.save_only_these_names("moe_up" if saved else "nothing")
    layer = jax.checkpoint(ffn("megablox", keep), policy=policy)
    loss = lambda *args: jnp.sum(layer(*args)[:ROUTED] * weights)  # noqa: E731
    count = count_step(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, gate, up, down))
    return sum(k.calls for k in count.kernels.values()), count.fallbacks


def test_kept_projections_spare_the_experts_forward_in_the_backward():
    # the forward's 3 grouped matmuls, and 2 per matmul backward (rows, weights): 9; a layer
    # keeping nothing reruns the gate and up projections first. The recompute branch for a
    # device holding more rows than it kept is the fallback the count leaves out.
    assert kernel_calls(saved=True, keep=128) == (9, 1)
    assert kernel_calls(saved=False, keep=128) == (11, 1)
    assert kernel_calls(saved=True, keep=ROWS) == (9, 0)  # the whole buffer: no fallback


def test_saved_rows_without_moe_up_kept_is_refused():
    with pytest.raises(ConfigError, match="model.moe.saved_rows sets how many rows `moe_up`"):
        MixtralConfig(moe=MoeConfig(saved_rows=1.25))
    config = MixtralConfig(moe=MoeConfig(saved_rows=1.25), remat_save=("moe_up", "moe_out"))
    assert config.moe.kept_rows(routed=1000, buffer=4096) == 1280  # 1.25 x 1000, tiles of 128
    assert config.moe.kept_rows(routed=10, buffer=4096) == 13  # tiny: no tile
    assert config.moe.kept_rows(routed=4000, buffer=4096) == 4096  # never past the buffer


@pytest.mark.parametrize("keep", [128, 64])  # fits / a device holds more (recomputed)
def test_expert_biases_add_per_row_and_sum_their_gradients_per_expert(keep):
    """Biases on the gate and up projections (gpt-oss): each routed row gets its expert's,
    and their gradients are each expert's rows' summed, by either backward branch."""
    x, gate, up, down, weights = inputs()
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    biases = tuple(jax.random.normal(k, (2, MLP)) for k in keys)
    mm = lambda a, w, s: grouped_matmul(a, w, s, impl="blocked", block=8, zero_rest=False)  # noqa: E731
    mm_grads = lambda a, w, s, dy: grouped_matmul_grads(a, w, s, dy, impl="blocked", block=8)  # noqa: E731

    def ours(x, gb, ub):
        out = expert_ffn(x, SIZES, gate, up, down, mm=mm, mm_grads=mm_grads, glu=_swiglu,
                         keep=keep, biases=(gb, ub))  # fmt: skip
        return jnp.sum(out[:ROUTED] * weights)

    def reference(x, gb, ub):
        ids = jnp.repeat(jnp.arange(2), SIZES, total_repeat_length=ROUTED)
        rmm = lambda a, w: grouped_matmul(a, w, SIZES, impl="ragged_dot")  # noqa: E731
        x = x[:ROUTED]
        h = _swiglu(rmm(x, gate) + gb[ids], rmm(x, up) + ub[ids])
        return jnp.sum(rmm(h, down) * weights)

    got = jax.jit(jax.value_and_grad(ours, argnums=(1, 2)))(x, *biases)
    want = jax.jit(jax.value_and_grad(reference, argnums=(1, 2)))(x, *biases)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
