"""Worker for the splash ring tests (8 fake CPU devices, a fresh process): prints JSON.

The ring with splash per chunk pair (Pallas interpret mode) against the blockwise ring:
outputs and dQ/dK/dV of a weighted sum, documents crossing the chunks; and the plan's
static count of the splash ring's kernels.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import context_parallel_run  # noqa: E402  (this folder: the worker's sys.path[0])
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from loomax.mesh import MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models.attention.ring_attention import RING_RESIDUALS  # noqa: E402
from loomax.models.attention.sequence_layout import zigzag_order  # noqa: E402
from loomax.models.axes import Batch, Heads, HeadSize, KeyPosition, KvHeads, Position  # noqa: E402
from loomax.models.blocks.remat import scan_policy  # noqa: E402
from loomax.plan.flops import count_step  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402

SEQ, HEAD, BLOCK = 1024, 128, 128
CASES = {  # name: (mesh sizes, batch, query heads, kv heads)
    "data2_context4": (dict(data=2, context=4), 2, 4, 2),  # chunks of one 128-block
    "context2_model4": (dict(context=2, model=4), 1, 8, 4),  # chunks of two blocks
}

REMATS = {"remat": scan_policy(True), "remat_saved": scan_policy(True, save=(RING_RESIDUALS,))}
"""Full layer remat, and remat that saves the ring's output and log-sum-exp."""


def inputs(order, batch: int, heads: int, kv_heads: int):
    """q, k, v, output weights and document ids (runs of 100 positions, so whole chunk
    pairs see no key for some queries) in ``order``."""
    rng = np.random.default_rng(0)
    axes = {
        "q": (Batch, Position, Heads, HeadSize),
        "k": (Batch, KeyPosition, KvHeads, HeadSize),
        "v": (Batch, KeyPosition, KvHeads, HeadSize),
        "w": (Batch, Position, Heads, HeadSize),
    }
    sizes = {"q": heads, "k": kv_heads, "v": kv_heads, "w": heads}
    named = [
        hax.named(jnp.asarray(rng.normal(size=(batch, SEQ, sizes[n], HEAD))[:, order]), axes[n])
        for n in "qkvw"
    ]
    seg = np.stack([np.arange(SEQ) // (100 + 7 * r) for r in range(batch)])
    return [*named, hax.named(jnp.asarray(seg[:, order], jnp.int32), (Batch, Position))]


def attention_loss(backend: str, remat=None):
    """Value and q/k/v gradients of a weighted sum of the ring's output; ``remat``: a Haliax
    scan policy (``models/blocks/remat.scan_policy``) the attention is checkpointed with."""
    return context_parallel_run.attention_loss(
        "ring", backend, 64, remat, splash_blocks=(BLOCK, BLOCK)
    )


def main() -> dict:
    result = {}
    for name, (sizes, batch, heads, kv_heads) in CASES.items():
        mesh = MeshConfig(**sizes).build()
        args = inputs(zigzag_order(SEQ, sizes["context"]), batch, heads, kv_heads)
        with MeshRuntime(mesh, make_axis_mappings()).mesh_context():
            (_, ref), ref_grads = attention_loss("blockwise")(*args)
            splash = attention_loss("splash").trace(*args)  # traced once: counted and run
            (_, out), grads = splash.lower().compile()(*args)
            count = count_step(splash.jaxpr)
            remats = {
                name: count_step(jax.make_jaxpr(attention_loss("splash", policy))(*args))
                for name, policy in REMATS.items()
            }
        # on the host (numpy): eager jnp ops compile per shape and sharding
        errors = {"out": float(np.max(np.abs(np.asarray(out.array) - np.asarray(ref.array))))}
        for g_name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
            errors[g_name] = float(np.max(np.abs(np.asarray(g.array) - np.asarray(r.array))))
        result[name] = {
            "errors": errors,
            "largest": float(np.max(np.abs(np.asarray(ref.array)))),
            "kernel_flops": count.kernel_flops,
            "dot_flops": count.dot_flops,
            "kernels": sorted({k.name for k in count.kernels.values()}),
            **{f"{n}_flops": c.kernel_flops for n, c in remats.items()},
            # splash passes per visible (query, key) pair and head dim: fwd 4, dq 6, dkv 8
            "causal_flops": 18.0 * batch * heads * HEAD * SEQ * (SEQ + 1) / 2,
        }
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
