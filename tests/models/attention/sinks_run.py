"""Worker for tests/models/attention/test_sinks.py (8 fake CPU devices, a fresh process):
attention with sinks through the ring and all-gather (data 2 x context 4) against one
device's vanilla attention, values and gradients (sinks included); prints JSON."""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from loomax.mesh import MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models.attention.attention import causal_attention  # noqa: E402
from loomax.models.attention.sequence_layout import zigzag_order  # noqa: E402
from loomax.models.axes import Batch, Heads, HeadSize, KeyPosition, KvHeads, Position  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402

SEQ, CONTEXT = 32, 4


def inputs(order):
    rng = np.random.default_rng(0)
    shapes = {"q": (2, SEQ, 4, 8), "k": (2, SEQ, 2, 8), "v": (2, SEQ, 2, 8), "w": (2, SEQ, 4, 8)}
    axes = {
        "q": (Batch, Position, Heads, HeadSize),
        "k": (Batch, KeyPosition, KvHeads, HeadSize),
        "v": (Batch, KeyPosition, KvHeads, HeadSize),
        "w": (Batch, Position, Heads, HeadSize),
    }
    named = {
        n: hax.named(jnp.asarray(rng.normal(size=s)[:, order], jnp.float32), axes[n])
        for n, s in shapes.items()
    }
    seg = np.stack([np.arange(SEQ) // 11, np.arange(SEQ) // 40])
    sinks = hax.named(jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32), (Heads,))
    return named, hax.named(jnp.asarray(seg[:, order], jnp.int32), (Batch, Position)), sinks


def grads(variant, backend):
    def loss(q, k, v, sinks, w, seg):
        out = causal_attention(
            q, k, v, backend=backend, segment_ids=seg, flash_block=4,
            context_parallel=variant, sinks=sinks,
        )  # fmt: skip
        return hax.sum(out * w).scalar(), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def main():
    named, seg, sinks = inputs(np.arange(SEQ))
    (_, ref), ref_grads = grads("ring", "vanilla")(
        named["q"], named["k"], named["v"], sinks, named["w"], seg
    )
    order = zigzag_order(SEQ, CONTEXT)
    laid, seg_l, _ = inputs(order)
    result = {}
    for variant in ("ring", "all_gather"):
        mesh = MeshConfig(data=2, context=CONTEXT).build()
        with MeshRuntime(mesh, make_axis_mappings()).mesh_context():
            args = (laid["q"], laid["k"], laid["v"], sinks, laid["w"], seg_l)
            (_, out), got = grads(variant, "blockwise")(*args)
        errors = {"out": float(jnp.max(jnp.abs(out.array - ref.array[:, order])))}
        for name, g, r in zip(("dq", "dk", "dv"), got[:3], ref_grads[:3], strict=True):
            errors[name] = float(jnp.max(jnp.abs(g.array - r.array[:, order])))
        errors["dsinks"] = float(jnp.max(jnp.abs(got[3].array - ref_grads[3].array)))
        errors["dsinks_size"] = float(jnp.max(jnp.abs(ref_grads[3].array)))
        result[variant] = errors
    print(json.dumps(result))


if __name__ == "__main__":
    main()
