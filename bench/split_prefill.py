"""A long prompt's prefill split over the context axis, against one device (figures, not tests).

For a Llama (``--hidden``, ``--layers``, 8 query / 2 KV heads of 64) and a ``--seq``-position
buffer: XLA's per-device account of the compiled prefill (``memory_analysis``: temporaries,
and the total with its arguments and outputs, the KV cache among them) and of one compiled
decode step on that cache, the cache's and weights' bytes on one device, then the
prefill's and a decode step's (median) wall time, for no split
(one device) and the split prefill with each ``model.context_parallel`` variant
(``models/decoding/split_prefill.py``). The fake devices share this machine's cores: times compare
work and collectives on one host, not real devices. The unsplit prefill is
``model.decode``'s, whose attention forms the whole score matrix (cached_attention):
``--no-split-estimate`` only compiles it (and times decode steps on an empty cache); one
device's blockwise forward (``hidden_states``, no cache) is compiled beside it as the
least an unsplit prefill could hold. ``--json PATH`` writes the rows.

.venv/bin/python bench/split_prefill.py [--seq 16384] [--context 8] [--steps 5]
    [--no-split-estimate]
"""

from __future__ import annotations

import argparse
import json
import os
import time

DEVICES = 8
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from loomax.mesh import MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.models.axes import Position  # noqa: E402
from loomax.models.decoding.generate import _cached_steps  # noqa: E402
from loomax.models.decoding.split_prefill import hidden_at, on_mesh, split_prefill  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402

MIB, VOCAB = 2**20, 512


def build(args, variant: str):
    config = LlamaConfig(
        seq_len=args.seq, hidden_dim=args.hidden, intermediate_dim=4 * args.hidden,
        num_layers=args.layers, num_heads=8, num_kv_heads=2, head_dim=64,
        context_parallel=variant, flash_attention_block_size=256,
    )  # fmt: skip
    return config.build(VOCAB, key=jax.random.PRNGKey(0))


def memory(compiled) -> dict:
    stats = compiled.memory_analysis()
    temp = stats.temp_size_in_bytes
    total = temp + stats.argument_size_in_bytes + stats.output_size_in_bytes
    return {"temp_mib": temp / MIB, "total_mib": total / MIB}


def per_device(tree) -> float:
    """MiB of ``tree``'s arrays on the first device."""
    first = jax.devices()[0]
    shards = (s for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == first)
    return sum(s.data.nbytes for s in shards) / MIB


def timed(fn, *args) -> tuple[object, float]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def unsplit_prefill(model, tokens):
    cache = model.init_cache((), tokens.shape[0], jnp.float32)
    hidden, cache = model.decode(hax.named(tokens, Position), cache, jnp.asarray(0))
    return cache, hidden[Position, -1]  # the last position's state, as sampling takes


def blockwise_forward(args) -> dict:
    """The compiled account of one device's forward (``hidden_states``: blockwise attention,
    O(seq) memory, no cache written): what a whole prefill could need at best."""
    model = jax.device_put(build(args, "ring"), jax.devices()[0])
    tokens = jax.ShapeDtypeStruct((args.seq,), jnp.int32)
    forward = jax.jit(lambda m, t: m.hidden_states(hax.named(t, Position)))
    with hax.axis_mapping({}):
        return {
            "case": "one device forward",
            "prefill": memory(forward.lower(model, tokens).compile()),
        }


def split_then_last(model, tokens):
    hidden, cache = split_prefill(model, hax.named(tokens, Position))
    return cache, hidden_at(hidden, tokens.shape[0] - 1)


def case(args, name: str, variant: str, tokens) -> dict:
    model = build(args, variant)
    if name == "no split":
        device = jax.devices()[0]
        model, tokens = jax.device_put((model, tokens), device)
        prefill, context = jax.jit(unsplit_prefill), None
    else:
        mesh = MeshConfig(data=1, context=args.context).build(jax.devices()[: args.context])
        model, context = on_mesh(model, mesh), MeshRuntime(mesh, make_axis_mappings())
        prefill = jax.jit(split_then_last)
    with context.mesh_context() if context else hax.axis_mapping({}):
        compiled = prefill.lower(model, tokens).compile()
        row = {"case": name, "prefill": memory(compiled)}
        if context is None and args.no_split_estimate:  # decode from an empty cache
            cache = jax.device_put(model.init_cache((), args.seq, jnp.float32), device)
        else:
            compiled(model, tokens)  # warm-up
            (cache, _), row["prefill_s"] = timed(compiled, model, tokens)
    row["cache_mib_per_device"] = per_device(cache)
    row["weights_mib_per_device"] = per_device(model)
    step = _cached_steps(0.0, None, None, None).next
    state = (cache, jnp.zeros(VOCAB, jnp.float32), jnp.zeros(VOCAB, bool))
    with hax.axis_mapping({}):
        pos, key = jnp.asarray(args.seq // 2), jax.random.PRNGKey(0)
        compiled = step.lower(model, state, pos, key).compile()
        row["decode_step"] = memory(compiled)
        state, _ = compiled(model, state, pos, key)  # warm-up (donates the state)
        times = []
        for i in range(args.steps):
            (state, _), seconds = timed(compiled, model, state, pos + 1 + i, key)
            times.append(seconds)
    row["decode_step_ms"] = 1e3 * float(np.median(times))
    return row


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: its arguments; None: ``sys.argv``'s)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="decode steps timed (median)")
    parser.add_argument("--cases", default="no split,ring,all_gather")
    parser.add_argument(
        "--no-split-estimate", action="store_true",
        help="compile the unsplit prefill only (its dense scores may not fit): memory, no times",
    )  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, args.seq), jnp.int32)
    variants = {"no split": "ring", "ring": "ring", "all_gather": "all_gather"}
    rows = [case(args, name, variants[name], tokens) for name in args.cases.split(",")]
    if "no split" in args.cases:
        rows.insert(1, blockwise_forward(args))
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
