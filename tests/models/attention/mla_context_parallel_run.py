"""Worker for MLA's context-parallel test (8 fake CPU devices, a fresh process): prints JSON.

MLA training on data 2 x context 4 (ring and all-gather, the sequence zig-zag laid out,
documents crossing the shards) against one device: the output and the gradients of the
weights, as the largest absolute differences.
"""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from loomax.mesh import MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.models.attention.mla import MlaAttention, MlaConfig  # noqa: E402
from loomax.models.attention.rotary import YarnRotary  # noqa: E402
from loomax.models.attention.sequence_layout import zigzag_order  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402

SEQ, CONTEXT = 32, 4


def run():
    rope = YarnRotary(factor=4.0, original_max_position_embeddings=8, mscale_all_dim=1.0)
    config = MlaConfig(
        hidden_dim=32, num_heads=4, q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, rope=rope,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, SEQ, 32)).astype(np.float32)
    w = rng.normal(size=(2, SEQ, 32)).astype(np.float32)
    seg = np.stack([np.arange(SEQ) // 7, np.arange(SEQ) // 11]).astype(np.int32)

    def named(a, order, last="embed"):
        axes = ("batch", "position", last) if a.ndim == 3 else ("batch", "position")
        return hax.named(jnp.asarray(a[:, order]), axes)

    def loss(module, x, w, seg):
        out = module(x, seg)
        return hax.sum(out * w).scalar(), out

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))

    def attempt(variant, order):
        settings = LlamaConfig(attn_backend="blockwise", flash_attention_block_size=4)
        settings = dataclasses.replace(settings, context_parallel=variant)
        module = MlaAttention.init(config, settings, key=jax.random.PRNGKey(0))
        args = (named(x, order), named(w, order), named(seg, order))
        (_, out), grads = grad(module, *args)
        leaves = [np.asarray(g) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array))]
        return np.asarray(out.array), leaves

    natural = np.arange(SEQ)
    ref_out, ref_grads = attempt("ring", natural)
    order = zigzag_order(SEQ, CONTEXT)
    result = {}
    for variant in ("ring",):
        mesh = MeshConfig(data=2, context=CONTEXT).build()
        with MeshRuntime(mesh, make_axis_mappings()).mesh_context():
            out, grads = attempt(variant, order)
        weight_error = max(
            float(np.max(np.abs(g - r))) for g, r in zip(grads, ref_grads, strict=True)
        )
        result[variant] = {
            "out": float(np.max(np.abs(out - ref_out[:, order]))),
            "weights": weight_error,
            "scale": float(max(np.max(np.abs(r)) for r in ref_grads)),
        }
    return result


if __name__ == "__main__":
    print(json.dumps(run()))
