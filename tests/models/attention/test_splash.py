"""The splash backend (Pallas's TPU kernel, in interpret mode on the CPU) against vanilla.

Tolerances: in float32 both backends take scores, softmax and sums in float32 and differ only
in summation order (the kernel's online softmax over key blocks), ~1e-6 relative, so 1e-5.
In bfloat16 both round the probabilities to bfloat16 before the PV matmul and the output
to bfloat16 (8 significant bits: a relative step of 2^-8 = 0.4%), at different points of
the online softmax, so values of order 1 agree to a few bfloat16 steps: 3e-2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models import LlamaConfig
from loomax.models.attention.attention import (
    causal_attention,
    resolve_backend,
    segment_ids_from_eos,
)
from loomax.models.attention.splash import splash_kernel_flops

B, T, H, KV, D, EOS = 2, 256, 4, 2, 16, 7
BLOCKS = (128, 128)  # two blocks each way: skipped, diagonal and full blocks all run
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


def inputs(kv_heads: int, dtype):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = hax.named(
        jax.random.normal(kq, (B, T, H, D), dtype), ("batch", "position", "heads", "head_size")
    )
    kv_name = "kv_heads" if kv_heads != H else "heads"
    axes = ("batch", "key_position", kv_name, "head_size")
    k = hax.named(jax.random.normal(kk, (B, T, kv_heads, D), dtype), axes)
    v = hax.named(jax.random.normal(kv, (B, T, kv_heads, D), dtype), axes)
    return q, k, v


def segments():
    tokens = np.full((B, T), 3, np.int32)
    tokens[0, [5, 130, 200]] = EOS  # documents across the block edge at 128
    tokens[1, [0, 127]] = EOS
    return segment_ids_from_eos(hax.named(jnp.asarray(tokens), ("batch", "position")), EOS)


@eqx.filter_jit
def value_and_grads(q, k, v, seg, backend):
    """The attention output and the gradients of ``sum(out * cotangent)`` for q, k and v."""
    cot = jax.random.normal(jax.random.PRNGKey(9), (B, T, H, D), jnp.float32)

    def f(qa, ka, va):
        out = causal_attention(
            hax.named(qa, q.axes),
            hax.named(ka, k.axes),
            hax.named(va, v.axes),
            backend=backend,
            segment_ids=seg,
            splash_blocks=BLOCKS,
        )
        out = out.rearrange(q.axes).array
        return jnp.sum(out.astype(jnp.float32) * cot), out

    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(
        q.array, k.array, v.array
    )
    return out, grads


@pytest.mark.parametrize(
    ("dtype", "masked", "kv_heads"),
    [
        (jnp.float32, True, KV),  # documents, grouped-query
        (jnp.float32, False, H),  # causal, multi-head
        (jnp.bfloat16, True, KV),
    ],
    ids=["f32-documents-gqa", "f32-causal-mha", "bf16-documents-gqa"],
)
def test_splash_values_and_gradients_equal_vanilla(dtype, masked, kv_heads):
    q, k, v = inputs(kv_heads, dtype)
    seg = segments() if masked else None
    got, got_grads = value_and_grads(q, k, v, seg, "splash")
    want, want_grads = value_and_grads(q, k, v, seg, "vanilla")
    tol = TOL[dtype]
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(got), f32(want), rtol=tol, atol=tol)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(f32(g), f32(w), rtol=tol, atol=tol, err_msg=f"d{name}")


def test_splash_blocks_and_sequence_are_checked_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"model.seq_len \(200\) must be a multiple of model.splash_block_q"
    ):
        LlamaConfig(attn_backend="splash", seq_len=200, splash_block_q=128, splash_block_kv=128)
    with pytest.raises(
        ConfigError, match="model.splash_block_kv must be a positive multiple of 128"
    ):
        LlamaConfig(splash_block_kv=100)
    with pytest.raises(ConfigError, match="model.attn_backend splash cannot serve"):
        resolve_backend("splash", jnp.bfloat16, 300, 128)


def test_auto_is_splash_on_tpu_where_the_sequence_splits_into_blocks():
    auto = lambda seq, platform: resolve_backend("auto", jnp.bfloat16, seq, 128, platform=platform)  # noqa: E731
    assert auto(8192, "tpu") == "splash"
    assert auto(4096, "tpu") == "splash"
    assert auto(1000, "tpu") == "vanilla"  # 1000 is no multiple of 128: pure JAX instead
    assert auto(8000, "tpu") == "blockwise"
    assert auto(8192, "cpu") == "blockwise"


def test_kernel_flops_count_the_visible_causal_pairs():
    # forward: QK^T and PV, 2 FLOPs each per pair and head dimension, over T(T+1)/2 pairs
    assert (
        splash_kernel_flops("splash_mha_fwd_residuals", (2, 4, 256, 16), 256)
        == 4 * 2 * 4 * 16 * 256 * 257 / 2
    )
    assert splash_kernel_flops("splash_mha_dkv_no_residuals", (4, 8, 16), 8) == 8 * 4 * 16 * 36
    assert splash_kernel_flops("my_kernel", (4, 8, 16), 8) is None


SHARDED = textwrap.dedent(
    """
    import json, haliax as hax, jax, jax.numpy as jnp, numpy as np
    from loomax.mesh import MeshConfig, make_axis_mappings
    from loomax.models import LlamaConfig
    from loomax.models.attention.attention import segment_ids_from_eos
    from loomax.runtime import MeshRuntime

    def logits(backend):
        config = LlamaConfig(seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=1,
                             num_heads=4, num_kv_heads=2, attn_backend=backend,
                             splash_block_q=128, splash_block_kv=128)
        model = config.build(64, key=jax.random.PRNGKey(0))
        runtime = MeshRuntime.create(MeshConfig(data=2, model=2), make_axis_mappings())
        tokens = hax.named(jax.random.randint(jax.random.PRNGKey(1), (4, 128), 0, 64), ("batch", "position"))
        f = runtime.jit(lambda m, t: m.logits(t, segment_ids=segment_ids_from_eos(t, 7)).array)
        with runtime.mesh_context():
            text = f.jitted.lower(model, tokens).as_text()
        return np.asarray(f(model, tokens)), text

    got, text = logits("splash")
    want, _ = logits("vanilla")
    print(json.dumps({"diff": float(np.abs(got - want).max()), "shard_map": "shard_map" in text or "sdy.manual_computation" in text}))
    """
)


def test_splash_runs_per_device_under_shard_map_on_a_data_and_model_mesh():
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
    }
    done = subprocess.run(
        [sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shard_map"], "the kernel is not inside a shard_map"
    assert result["diff"] < 1e-4, result
