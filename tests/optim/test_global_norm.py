"""global_norm: bitwise optax's norm, traced once per step; clipping by it equals optax's."""

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


def test_norm_is_bitwise_optax():
    norm, ref = jax.jit(global_norm), jax.jit(optax.tree.norm)
    complex_tree = {"z": jnp.array([1 + 2j, 3 - 1j], jnp.complex64)}
    for t in (tree(), tree(1e-3), {"a": jnp.array([jnp.inf, 1.0])}, {}, complex_tree):
        same_bits(norm(t), ref(t))


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
    same_bits(a, optax.tree.norm(t))
    same_bits(c, optax.tree.norm(jax.tree.map(lambda x: x * 2, t)))


def test_a_norm_traced_inside_a_branch_is_not_reused_outside():
    def f(t):
        with norms_shared():
            inner = jax.lax.cond(True, lambda: global_norm(t), lambda: 0.0)
            return inner + global_norm(t)  # the branch's tracer would leak if reused

    same_bits(jax.jit(f)(tree()), 2 * optax.tree.norm(tree()))


@pytest.mark.parametrize("scale", [1.0, 1e-3])  # clipped, and left alone
def test_clipping_equals_optax(scale):
    t = {k: v for k, v in tree(scale).items() if v is not None}
    ours = clip_by_global_norm(0.5)
    theirs = optax.clip_by_global_norm(0.5)
    state = ours.init(t)
    assert state == theirs.init(t)  # checkpoints keep their layout
    with norms_shared():
        clipped, _ = jax.jit(ours.update)(t, state)
    same_bits(clipped, jax.jit(theirs.update)(t, state)[0])
    if scale == 1.0:
        assert abs(float(optax.tree.norm(clipped)) - 0.5) < 1e-2
    else:
        same_bits(clipped, t)
