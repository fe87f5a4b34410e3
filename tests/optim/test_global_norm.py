"""global_norm: optax's norm summed in a fixed order (the same bits at any sharding: the
staged resume in tests/models/blocks/test_pipeline.py), traced once per step; clipping by it
equals optax's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loomax.optim.global_norm import clip_by_global_norm, global_norm, norms_shared


def tree(scale: float = 1.0) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return {
        "w": scale * jax.random.normal(keys[0], (7, 5)),
        "b": scale * jax.random.normal(keys[1], (5,)),
        "h": (scale * jax.random.normal(keys[2], (3, 4))).astype(jnp.bfloat16),
        "none": None,
        "s": scale * jax.random.normal(keys[3], ()),
    }


def same_bits(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def widened(t):
    """``t`` with bfloat16 leaves in float32, as ``global_norm`` squares them (optax squares
    them in bfloat16: 8e-5 off here)."""
    return jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, t)


@jax.jit
def ordered_norm(t) -> jax.Array:
    """The fixed order by hand: per row of the first axis, then the rows, then the leaves."""
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(t):
        sq = jnp.square(jnp.abs(x).astype(jnp.float32))
        total = total + jnp.sum(jnp.sum(sq, axis=tuple(range(1, sq.ndim))) if sq.ndim > 1 else sq)
    return jnp.sqrt(total)


def test_norm_is_optaxs_summed_in_a_fixed_order():
    norm, ref = jax.jit(global_norm), jax.jit(optax.tree.norm)
    complex_tree = {"z": jnp.array([1 + 2j, 3 - 1j], jnp.complex64)}
    for t in (tree(), tree(1e-3), {"a": jnp.array([jnp.inf, 1.0])}, {}, complex_tree):
        same_bits(norm(t), ordered_norm(t))
        np.testing.assert_allclose(norm(t), ref(widened(t)), rtol=1e-6)


def count_sqrt(fn, *args) -> int:
    return sum(e.primitive.name == "sqrt" for e in jax.make_jaxpr(fn)(*args).eqns)


def test_norm_of_the_same_arrays_is_traced_once_inside_norms_shared():
    def twice(t):
        return global_norm(t), global_norm(dict(t)), global_norm(jax.tree.map(lambda x: x * 2, t))

    def shared(t):
        with norms_shared():
            return twice(t)

    t = tree()
    assert count_sqrt(twice, t) == 3  # outside: every call traces its own
    assert count_sqrt(shared, t) == 2  # the same arrays once, the doubled ones apart
    a, b, c = jax.jit(shared)(t)
    same_bits(a, b)
    same_bits(a, ordered_norm(t))
    same_bits(c, ordered_norm(jax.tree.map(lambda x: x * 2, t)))


def test_a_norm_traced_inside_a_branch_is_not_reused_outside():
    def f(t):
        with norms_shared():
            inner = jax.lax.cond(True, lambda: global_norm(t), lambda: 0.0)
            return inner + global_norm(t)  # the branch's tracer would leak if reused

    same_bits(jax.jit(f)(tree()), 2 * ordered_norm(tree()))


@pytest.mark.parametrize("scale", [1.0, 1e-3])  # clipped, and left alone
def test_clipping_equals_optax(scale):
    t = {k: v for k, v in tree(scale).items() if v is not None}
    ours = clip_by_global_norm(0.5)
    theirs = optax.clip_by_global_norm(0.5)
    state = ours.init(t)
    assert state == theirs.init(t)  # checkpoints keep their layout
    with norms_shared():
        clipped, _ = jax.jit(ours.update)(t, state)
    for a, b in zip(
        jax.tree.leaves(clipped), jax.tree.leaves(theirs.update(widened(t), state)[0]), strict=True
    ):
        np.testing.assert_allclose(
            np.asarray(a, np.float32),
            np.asarray(b, np.float32),
            rtol=1e-2 if a.dtype == jnp.bfloat16 else 1e-6,
        )
    if scale == 1.0:
        assert abs(float(optax.tree.norm(clipped)) - 0.5) < 1e-2
    else:
        same_bits(clipped, t)
