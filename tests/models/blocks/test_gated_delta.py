"""The gated delta rule (``models/blocks/gated_delta.py``): the chunked (WY) form equals the
step-by-step recurrence in float64 on random inputs, values and gradients, to 1e-10, for
chunks that do and do not divide the sequence; document resets keep packed documents apart
(each document's outputs are those of it alone); a decode step continues the chunked state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.models.blocks.gated_delta import (
    chunked_gated_delta,
    gated_delta_step,
    recurrent_gated_delta,
)

B, T, H, DK, DV = 2, 37, 2, 4, 5


def inputs(seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    normal = lambda k, s: jax.random.normal(k, s, jnp.float64)  # noqa: E731
    q, k = (normal(key, (B, T, H, DK)) for key in keys[:2])
    q, k = (a / jnp.linalg.norm(a, axis=-1, keepdims=True) for a in (q, k))  # as Qwen3-Next
    v = normal(keys[2], (B, T, H, DV))
    g = -jax.nn.softplus(normal(keys[3], (B, T, H)))  # log decay <= 0
    beta = jax.nn.sigmoid(normal(keys[4], (B, T, H)))
    reset = jnp.zeros((B, T), bool).at[0, 0].set(True).at[0, 11].set(True).at[1, 30].set(True)
    return q, k, v, g, beta, reset


@pytest.mark.parametrize("chunk", [8, 16, 37])
def test_chunked_equals_the_recurrence_in_value_and_gradient(chunk):
    with jax.enable_x64(True):
        q, k, v, g, beta, reset = inputs()
        w_out = jax.random.normal(jax.random.PRNGKey(9), (B, T, H, DV), jnp.float64)
        w_state = jax.random.normal(jax.random.PRNGKey(8), (B, H, DK, DV), jnp.float64)

        def loss(fn):
            def f(q, k, v, g, beta):
                out, state = fn(q, k, v, g, beta, reset=reset)
                return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)

            return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))

        (_, (out, state)), grads = loss(lambda *a, **kw: chunked_gated_delta(*a, chunk, **kw))(
            q, k, v, g, beta
        )
        (_, (ref, ref_state)), ref_grads = loss(recurrent_gated_delta)(q, k, v, g, beta)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, ref, atol=1e-10, rtol=0)
        np.testing.assert_allclose(state, ref_state, atol=1e-10, rtol=0)
        for a, b in zip(grads, ref_grads, strict=True):
            assert float(jnp.max(jnp.abs(b))) > 1e-2
            np.testing.assert_allclose(a, b, atol=1e-10, rtol=0)


def test_documents_never_see_each_other():
    """Row 0 holds documents [0, 11) and [11, 37): the second's outputs are those of the
    second alone, whatever the first holds."""
    with jax.enable_x64(True):
        q, k, v, g, beta, reset = inputs()
        out, _ = chunked_gated_delta(q, k, v, g, beta, 8, reset=reset)
        alone, _ = chunked_gated_delta(*(a[:1, 11:] for a in (q, k, v, g, beta)), 8)
        np.testing.assert_allclose(out[0, 11:], alone[0], atol=1e-12, rtol=0)
        noisy = v.at[0, :11].add(100.0)
        out2, _ = chunked_gated_delta(q, k, noisy, g, beta, 8, reset=reset)
        np.testing.assert_allclose(out2[0, 11:], out[0, 11:], atol=1e-12, rtol=0)
        assert not np.allclose(out2[0, :11], out[0, :11])
        no_reset, _ = chunked_gated_delta(q, k, noisy, g, beta, 8)
        assert not np.allclose(no_reset[0, 11:], out[0, 11:])  # without the reset it leaks


def test_a_decode_step_continues_the_chunked_state():
    with jax.enable_x64(True):
        q, k, v, g, beta, _ = inputs()
        _, state = chunked_gated_delta(*(a[:, :-1] for a in (q, k, v, g, beta)), 8)
        _, o = gated_delta_step(state, *(a[:, -1] for a in (q, k, v, g, beta)))
        whole, _ = recurrent_gated_delta(q, k, v, g, beta)
        np.testing.assert_allclose(o, whole[:, -1], atol=1e-10, rtol=0)
