"""The fused, blocked LM-head cross-entropy equals the plain one, in value and gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.models.blocks import taps
from loomax.models.blocks.logits_stats import logits_stats
from loomax.models.loss import fused_cross_entropy_sum, plain_cross_entropy_sum


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def problem(n=37, d=16, v=101, seed=0):
    """Hidden states, LM head, targets and a mask: one compiled program a shape."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = jax.random.normal(k1, (n, d))
    w = jax.random.normal(k2, (v, d)) * 0.3
    t = jax.random.randint(k3, (n,), 0, v)
    m = (jax.random.uniform(k4, (n,)) > 0.2).astype(jnp.float32)
    return h, w, t, m


@pytest.mark.parametrize("block", [1, 8, 16, 37, 64])
def test_value_and_gradients_match_plain(block):
    h, w, t, m = problem()

    @jax.jit  # one program a case (op by op, the scans' pieces compiled one by one)
    def run(h, w, t, m):
        ref = jax.value_and_grad(plain_cross_entropy_sum, argnums=(0, 1, 3))(h, w, t, m)
        val = fused_cross_entropy_sum(h, w, t, m, block)
        fused = lambda h, w, m: fused_cross_entropy_sum(h, w, t, m, block)  # noqa: E731
        grads = jax.grad(fused, argnums=(0, 1, 2))(h, w, m)
        _, fwd_grads = jax.value_and_grad(fused, argnums=(0, 1, 2))(h, w, m)
        return ref, val, grads, fwd_grads

    (ref, ref_grads), val, grads, fwd_grads = run(h, w, t, m)
    np.testing.assert_allclose(val, ref, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(fwd_grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_cotangent_scales_gradient():
    h, w, t, m = problem()
    g1, g3 = jax.jit(
        lambda h: (
            jax.grad(lambda h: fused_cross_entropy_sum(h, w, t, m, 8))(h),
            jax.grad(lambda h: 3.0 * fused_cross_entropy_sum(h, w, t, m, 8))(h),
        )
    )(h)
    np.testing.assert_allclose(g3, 3 * g1, rtol=1e-6)


def test_extreme_logits_stay_finite():
    h, w, t, m = problem()
    h = h * 1e3
    fused = lambda h: fused_cross_entropy_sum(h, w, t, m, 16)  # noqa: E731
    (val, grads), plain = jax.jit(
        lambda h: (jax.value_and_grad(fused)(h), plain_cross_entropy_sum(h, w, t, m))
    )(h)
    assert np.isfinite(val) and np.all(np.isfinite(grads))
    np.testing.assert_allclose(val, plain, rtol=1e-5)


@pytest.mark.parametrize("block", [8, 37])
def test_z_loss_value_and_gradients_match_plain(block):
    h, w, t, m = problem()
    z = 1e-3

    @jax.jit
    def run(h, w):
        ref = jax.value_and_grad(plain_cross_entropy_sum, argnums=(0, 1))(h, w, t, m, z)
        fused = lambda h, w: fused_cross_entropy_sum(h, w, t, m, block, z)  # noqa: E731
        return (
            ref,
            jax.value_and_grad(fused, argnums=(0, 1))(h, w),
            plain_cross_entropy_sum(h, w, t, m),
        )

    (ref, ref_grads), (val, grads), without_z = run(h, w)
    np.testing.assert_allclose(val, ref, rtol=1e-5)
    assert val > without_z
    for got, want in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("multiple", [8, 128])
def test_padded_vocabulary_matches_plain(multiple):
    """The head padded to a multiple of rows (101 -> 104 or 128), the padding masked: the
    value, both gradients and the primal-only path equal the plain loss, and the weight's
    gradient keeps the vocabulary's 101 rows."""
    h, w, t, m = problem()
    z = 1e-3

    def fused(h, w):
        return fused_cross_entropy_sum(h, w, t, m, 16, z, None, multiple)

    grads = _fused_equals_plain(fused, h, w, t, m, z)
    assert grads[1].shape == w.shape


@pytest.mark.parametrize("block,vocab_block", [(8, 16), (37, 101), (16, 7)])
def test_vocab_blocks_match_plain(block, vocab_block):
    h, w, t, m = problem()
    z = 1e-3

    def fused(h, w):
        return fused_cross_entropy_sum(h, w, t, m, block, z, vocab_block)

    _fused_equals_plain(fused, h, w, t, m, z)


@pytest.mark.parametrize("block", [8, 37])
def test_logits_statistics_block_by_block_equal_those_of_the_whole_logits(block):
    h, w, _, _ = problem()
    h = h.at[3].set(0.0)  # a row of exact zeros: near-zero logits to count
    got = jax.jit(logits_stats, static_argnums=2)(h, w, block)  # 37 rows: padding at 8
    want = jax.jit(lambda h, w: taps.stats_of(h @ w.T))(h, w)
    assert float(want["near_zero"]) >= 101 / (37 * 101)
    for stat in taps.STATS:
        np.testing.assert_allclose(got[stat], want[stat], rtol=1e-5, atol=1e-7, err_msg=stat)
    _, _, t, m = problem()
    grad, ref = jax.jit(lambda h: (
        jax.grad(lambda h: fused_cross_entropy_sum(h, w, t, m, block)
                 + logits_stats(h, w, block)["rms"])(h),
        jax.grad(lambda h: fused_cross_entropy_sum(h, w, t, m, block))(h),
    ))(h)  # fmt: skip
    np.testing.assert_array_equal(grad, ref)  # outside the gradient


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(vocab_block_size=32), dict(softcap=30.0)],
    ids=["fused", "vocab-blocks", "softcap"],
)
def test_the_per_device_loss_equals_plain(settings):
    """``per_device_sum`` (the fused loss on each device's own rows, in a ``shard_map``):
    value and gradients equal the plain loss's. (Its ``check_vma`` is off: DiLoCo's vmap over
    ``replica`` makes the rows vary over an axis the shard_map does not name.)"""
    import haliax as hax
    from jax.sharding import Mesh

    from loomax.mesh import MESH_AXES, make_axis_mappings
    from loomax.models.loss import capped_cross_entropy_sum, per_device_sum

    h, w, t, m = problem(n=32)
    rows = [x.reshape(4, 8, *x.shape[1:]) for x in (h, t, m)]
    softcap = settings.pop("softcap", None)

    def fused(h, w, t, m):
        if softcap is not None:
            return capped_cross_entropy_sum(h, w, t, m, 8, 1e-4, softcap)
        return fused_cross_entropy_sum(h, w, t, m, 8, 1e-4, settings.get("vocab_block_size"))

    def loss(w, h, t, m):
        return per_device_sum(fused, w, h, t, m)

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1, 1, 1), MESH_AXES)
    with jax.set_mesh(mesh), hax.axis_mapping(make_axis_mappings().compute):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(w, *rows)
        val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, *rows)
    assert [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]

    def plain(w, h):
        return plain_cross_entropy_sum(h, w, t, m, 1e-4, softcap)

    ref, ref_grads = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(w, h)
    np.testing.assert_allclose(val, ref, rtol=1e-5)
    np.testing.assert_allclose(grads[0], ref_grads[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1].reshape(h.shape), ref_grads[1], rtol=1e-5, atol=1e-6)


def _fused_equals_plain(fused, h, w, t, m, z):
    """``fused(h, w)``'s value, primal-only value and both gradients against the plain loss's,
    all from one jitted program; returns the fused gradients."""

    @jax.jit
    def run(h, w):
        ref = jax.value_and_grad(plain_cross_entropy_sum, argnums=(0, 1))(h, w, t, m, z)
        return ref, fused(h, w), jax.value_and_grad(fused, argnums=(0, 1))(h, w)

    (ref, ref_grads), primal, (val, grads) = run(h, w)
    np.testing.assert_allclose(primal, ref, rtol=1e-5)
    np.testing.assert_allclose(val, ref, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return grads
