"""The blockwise (flash) backend's memory: O(seq) also inside a differentiated layer scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from loomax.models.attention.flash import flash_attention

B, KV, GROUP, T, D, BLOCK = 1, 2, 2, 2048, 32, 128


def _layers_loss(remat: bool):
    """The sum of two layers' attention outputs, the layers a ``lax.scan`` as in the models
    (the segments are the same for every layer: loop-invariant)."""

    def layer(x, seg):
        return flash_attention(x, x[:, :, 0], x[:, :, 1], seg, D**-0.5, BLOCK)

    def loss(x, seg):
        step = jax.checkpoint(layer) if remat else layer
        y, _ = jax.lax.scan(lambda c, _: (step(c, seg), None), x, None, length=2)
        return jnp.sum(y.astype(jnp.float32))

    return loss


@pytest.mark.parametrize("remat", [False, True])
def test_gradient_through_a_layer_scan_needs_no_seq_squared_buffers(remat):
    """JAX hoists what depends only on the segments out of a differentiated scan; without
    the barrier in ``_flash_forward`` that was every block pair's mask and fill values,
    stacked: 177 MiB here (5.3 GiB at 4,096 positions and 32 heads), more than the whole
    score matrix a plain attention holds."""
    x = jax.ShapeDtypeStruct((B, KV, GROUP, T, D), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
    compiled = jax.jit(jax.grad(_layers_loss(remat))).lower(x, seg).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    scores = B * KV * GROUP * T * T * 4  # one layer's float32 scores, all heads
    assert temp < scores / 4, f"{temp / 2**20:.1f} MiB of temporaries"


def test_gradient_through_a_layer_scan_equals_the_unrolled_one():
    """The barrier changes where work happens, not results (to float rounding: the scanned
    and the unrolled program fuse differently)."""
    x = jax.random.normal(jax.random.key(0), (B, KV, GROUP, 256, D), jnp.float32)
    seg = jnp.repeat(jnp.arange(4), 64)[None]

    def layer(x):
        return flash_attention(x, x[:, :, 0], x[:, :, 1], seg, D**-0.5, 64)

    def scanned(x):
        return jnp.sum(jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=2)[0])

    def unrolled(x):
        return jnp.sum(layer(layer(x)))

    assert jnp.allclose(jax.grad(scanned)(x), jax.grad(unrolled)(x), rtol=1e-4, atol=1e-5)
