"""Worker for the context-parallel tests (8 fake CPU devices, a fresh process): prints JSON.

python context_parallel_run.py attention   # ring / all_gather vs one device: values, grads, HLO
python context_parallel_run.py train       # a tiny Llama: 1 device vs data 2 x context 4
python context_parallel_run.py memory      # compiled attention fwd+bwd bytes per device
python context_parallel_run.py bench       # bench/context_parallel.py at 256 positions, context 8
python context_parallel_run.py attention memory train bench   # several: {mode: result}, one process
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jmp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
from bench_main import bench_rows  # noqa: E402

from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.hooks.eval import make_loss_evaluator  # noqa: E402
from loomax.lm.loss import lm_loss_for  # noqa: E402
from loomax.mesh import MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models import Gpt2Config, LlamaConfig  # noqa: E402
from loomax.models.attention import ring_attention  # noqa: E402
from loomax.models.attention.attention import causal_attention  # noqa: E402
from loomax.models.attention.sequence_layout import zigzag_order  # noqa: E402
from loomax.models.axes import Batch, Heads, HeadSize, KeyPosition, KvHeads, Position  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402

SEQ, CONTEXT = 64, 4


def attention_inputs(order):
    """q (4 heads), k/v (2 kv heads), documents that cross the shard boundaries, output weights;
    in true order, then taken to ``order``."""
    rng = np.random.default_rng(0)
    arrays = {
        "q": rng.normal(size=(2, SEQ, 4, 8)),
        "k": rng.normal(size=(2, SEQ, 2, 8)),
        "v": rng.normal(size=(2, SEQ, 2, 8)),
        "w": rng.normal(size=(2, SEQ, 4, 8)),
    }
    seg = np.stack([np.arange(SEQ) // 13, np.arange(SEQ) // 21])  # 8-token shards, longer docs
    axes = {
        "q": (Batch, Position, Heads, HeadSize),
        "k": (Batch, KeyPosition, KvHeads, HeadSize),
        "v": (Batch, KeyPosition, KvHeads, HeadSize),
        "w": (Batch, Position, Heads, HeadSize),
    }
    named = {
        n: hax.named(jnp.asarray(a[:, order], jnp.float32), axes[n]) for n, a in arrays.items()
    }
    return named, hax.named(jnp.asarray(seg[:, order], jnp.int32), (Batch, Position))


def attention_loss(variant, backend="vanilla", block=4, remat=None, **options):
    """The gradient of a weighted sum of the attention output; ``remat``: a Haliax scan
    policy (``models/blocks/remat.scan_policy``) the attention is checkpointed with; ``options``
    more of ``causal_attention``'s (e.g. ``splash_blocks``). Also ``ring_splash_run.py``'s."""

    def loss(q, k, v, w, seg):
        def attend(q, k, v):
            return causal_attention(
                q, k, v, backend=backend, segment_ids=seg, flash_block=block,
                context_parallel=variant, **options,
            )  # fmt: skip

        if remat is not None:
            attend = remat.checkpoint("carry", "input", attend)
        out = attend(q, k, v)
        return hax.sum(out * w).scalar(), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def attention_counts():
    """The plan's matmul count (``plan/flops.count_step``) of the ring's forward + backward
    (data 2 x context 4): as is, under full remat, and under remat saving the ring's
    residuals; and the causal count (half of each of the 7 score-sized matmuls)."""
    from loomax.models.attention.ring_attention import RING_RESIDUALS
    from loomax.models.blocks.remat import scan_policy
    from loomax.plan.flops import count_step

    laid, seg = attention_inputs(zigzag_order(SEQ, CONTEXT))
    args = [laid[n] for n in "qkvw"] + [seg]
    mesh = MeshConfig(data=2, context=CONTEXT).build()
    policies = {"ring": None, "ring_remat": scan_policy(True)}
    policies["ring_remat_saved"] = scan_policy(True, save=(RING_RESIDUALS,))
    counts = {}
    with MeshRuntime(mesh, make_axis_mappings()).mesh_context():
        for name, remat in policies.items():
            jaxpr = jax.make_jaxpr(attention_loss("ring", "blockwise", remat=remat))(*args)
            counts[name] = count_step(jaxpr).total_flops
    batch, heads, size = laid["q"].array.shape[0], laid["q"].array.shape[2], 8
    counts["causal"] = 7 * 2 * batch * heads * size * SEQ * SEQ / 2
    return counts


def attention():
    natural, seg = attention_inputs(np.arange(SEQ))
    (_, ref_out), ref_grads = attention_loss("ring")(*[natural[n] for n in "qkvw"], seg)
    ref = [np.asarray(a.array) for a in (ref_out, *ref_grads)]
    order = zigzag_order(SEQ, CONTEXT)
    laid, seg_l = attention_inputs(order)
    result = {}
    cases = [("ring", 2, 1), ("all_gather", 2, 1), ("ring_tensor_parallel", 1, 2)]
    cases.append(("ring_padded", 2, 1))  # blocks of 3: each 8-position chunk padded to 9
    cases.append(("ring_overlapped", 2, 1))  # the TPU/GPU program's schedule, run on CPUs
    for name, data, model in cases:
        mesh = MeshConfig(data=data, context=CONTEXT, model=model).build()
        runtime = MeshRuntime(mesh, make_axis_mappings())
        variant = name.removesuffix("_tensor_parallel").removesuffix("_padded")
        variant = variant.removesuffix("_overlapped")
        block = 3 if name.endswith("_padded") else 4
        fn = attention_loss(variant, backend="blockwise", block=block)
        cpu_program = ring_attention.cpu_program
        if name.endswith("_overlapped"):  # packed hops, dK/dV one hop behind, no _after
            ring_attention.cpu_program = lambda: False
        try:
            with runtime.mesh_context():
                args = [laid[n] for n in "qkvw"] + [seg_l]
                compiled = fn.lower(*args).compile()  # run and read: one compile
                (_, out), grads = compiled(*args)
                hlo = compiled.as_text()
        finally:
            ring_attention.cpu_program = cpu_program
        # on the host (numpy): eager jnp ops compile per shape and sharding
        errors = {"out": float(np.max(np.abs(np.asarray(out.array) - ref[0][:, order])))}
        for grad_name, g, r in zip(("dq", "dk", "dv"), grads, ref[1:], strict=True):
            errors[grad_name] = float(np.max(np.abs(np.asarray(g.array) - r[:, order])))
        result[name] = {
            "errors": errors,
            "all_gathers": hlo.count(" all-gather("),
            "collective_permutes": hlo.count(" collective-permute("),
        }
    result["counts"] = attention_counts()
    return result


TRAIN_SEQ, VOCAB, STEPS, BATCH, EOS = 256, 64, 4, 4, 0


def train_losses(mesh: MeshConfig, devices, variant: str = "ring") -> list[float]:
    """Losses of a few steps of a tiny grouped-query Llama with document masks (EOS = 0),
    then the evaluation loss of the final weights on two batches."""
    model = LlamaConfig(
        seq_len=TRAIN_SEQ, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=2, context_parallel=variant, cross_entropy_block_size=128,
    )  # fmt: skip
    config = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=BATCH,
        mesh=mesh,
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=tempfile.mkdtemp(),
    )
    optimizer = AdamConfig(learning_rate=3e-3, warmup=0)
    loss = lm_loss_for(model, eos_id=EOS)
    trainer = Trainer(config, optimizer.build(STEPS), loss, run_id="cp", devices=devices)
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    state = trainer.initial_state(lambda key: model.build(VOCAB, key=key))
    tokens = np.random.default_rng(0).integers(0, VOCAB, 20 * TRAIN_SEQ, dtype=np.int32)
    loader = BatchLoader(TokenWindows(tokens, TRAIN_SEQ), BATCH, seed=0)
    final = trainer.train(state, loader.iter_from(0, 0, 1))
    batches = [loader.batch(STEPS + i) for i in range(2)]
    evaluate = make_loss_evaluator(
        loss, batches, jmp.get_policy(config.mp), jit=trainer.runtime.jit,
        prepare=trainer.runtime.shard_batch,
    )  # fmt: skip
    return [*losses, evaluate(final.state.model)["eval/loss"]]


@functools.cache
def one_device_gradients(restart: bool) -> tuple[np.ndarray, ...]:
    """``loss_gradients`` on one device, worked out once for every mesh compared with it."""
    return tuple(loss_gradients(MeshConfig(data=1), jax.devices()[:1], restart))


def loss_gradients(mesh: MeshConfig, devices, restart: bool = False) -> list[np.ndarray]:
    """The logits (``model.logits``) and the gradients of the mean loss (with document masks)
    of a tiny GPT-2's initial weights (learned positions; per document with ``restart``:
    ``model.document_positions``) on one batch."""
    model = Gpt2Config(
        seq_len=TRAIN_SEQ, hidden_dim=32, num_layers=2, num_heads=4, cross_entropy_block_size=128,
        document_positions=restart,
    )  # fmt: skip
    runtime = MeshRuntime(mesh.build(devices), make_axis_mappings())
    loss = lm_loss_for(model, eos_id=EOS)
    params = model.build(VOCAB, key=jax.random.PRNGKey(0))
    tokens = np.random.default_rng(1).integers(0, VOCAB, (BATCH, TRAIN_SEQ), dtype=np.int32)

    def mean_loss(params, tokens):
        (total, weight), _ = loss(params, tokens)
        return total / weight

    def logits(params, tokens):
        return params.logits(hax.named(tokens, (Batch, Position))).array

    with runtime.mesh_context():
        batch = runtime.shard_batch(tokens)
        grad = jax.jit(jax.grad(mean_loss)).lower(params, batch).compile()  # run and read
        grads = grad(params, batch)
        out = jax.jit(logits)(params, batch)
    LARGEST_COLLECTIVE[str(mesh)] = largest_collective(grad.as_text())
    return [np.asarray(out)] + [np.asarray(g) for g in jax.tree.leaves(grads)]


LARGEST_COLLECTIVE: dict[str, int] = {}
"""Per mesh of ``loss_gradients``: elements of the largest array an all-reduce or all-gather
of its compiled gradient program produces."""


def largest_collective(hlo: str) -> int:
    """Elements of the largest array an all-reduce or all-gather of the compiled ``hlo`` makes."""
    sizes = [0]
    for line in hlo.splitlines():
        found = re.search(r" = (.*?) (all-reduce|all-gather)(-start)?\(", line)
        for dims in re.findall(r"\[([\d,]*)\]", found.group(1) if found else ""):
            sizes.append(math.prod(int(d) for d in dims.split(",") if d))
    return max(sizes)


def gradient_error(mesh: MeshConfig | None = None, restart: bool = False) -> float:
    """Largest difference of the logits and of each gradient, ``mesh`` (on the first devices
    it needs; data 2 x context when None) against one device, relative to the largest entry
    of each."""
    mesh = mesh or MeshConfig(data=2, context=CONTEXT)
    one = one_device_gradients(restart)
    count = math.prod(v for v in mesh.as_dict().values() if v > 0)
    split = loss_gradients(mesh, jax.devices()[:count], restart)
    return max(
        float(np.max(np.abs(a - b)) / np.max(np.abs(a))) for a, b in zip(one, split, strict=True)
    )


def train():
    devices = jax.devices()
    data4 = MeshConfig(data=BATCH)
    return {
        "gradient_error": gradient_error(),
        "document_positions_gradient_error": gradient_error(restart=True),
        # rows split over data alone: the fused loss runs per device, as under context
        "data4_gradient_error": gradient_error(data4),
        "data4_largest_collective": LARGEST_COLLECTIVE[str(data4)],
        "hidden_elements": BATCH * TRAIN_SEQ * 32,
        "one_device": train_losses(MeshConfig(data=1), devices[:1]),
        "ring": train_losses(MeshConfig(data=2, context=CONTEXT), devices),
    }


def attention_bytes(
    context: int,
    variant: str,
    *,
    seq: int = 1024,
    heads: int = 4,
    kv_heads: int = 2,
    size: int = 16,
    flash_block: int | None = 16,
) -> dict:
    """XLA's per-device account (``memory_analysis``) of the compiled forward + backward of one
    causal attention (``seq`` positions, ``heads`` query / ``kv_heads`` KV heads of ``size``,
    blocks of ``flash_block`` (None: the default), documents; a weighted sum of the output as
    the loss, so its cotangent is a real input), compile only: temporaries, and in "total"
    also the arguments (q, k, v, weights, documents) and outputs (dQ, dK, dV) a device holds.
    Also ``bench/context_parallel.py``'s attention memory."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = MeshConfig(data=1, context=context).build(jax.devices()[:context])
    split = NamedSharding(mesh, P(None, "context"))
    q = jax.ShapeDtypeStruct((1, seq, heads, size), jnp.float32, sharding=split)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, size), jnp.float32, sharding=split)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=split)
    blocks = {} if flash_block is None else {"flash_block": flash_block}

    def loss(q, k, v, w, seg):
        out = causal_attention(
            hax.named(q, (Batch, Position, Heads, HeadSize)),
            hax.named(k, (Batch, KeyPosition, KvHeads, HeadSize)),
            hax.named(v, (Batch, KeyPosition, KvHeads, HeadSize)),
            backend="blockwise",
            segment_ids=hax.named(seg, (Batch, Position)),
            context_parallel=variant,
            **blocks,
        )
        return (out.array * w).sum()

    with MeshRuntime(mesh, make_axis_mappings()).mesh_context():
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, q, seg).compile()
    stats = compiled.memory_analysis()
    temp = stats.temp_size_in_bytes
    return {"temp": temp, "total": temp + stats.argument_size_in_bytes + stats.output_size_in_bytes}


def memory():
    return {
        "one_device": attention_bytes(1, "ring"),
        "ring": attention_bytes(CONTEXT, "ring"),
        "all_gather": attention_bytes(CONTEXT, "all_gather"),
        # zig-zag chunks of 256 positions: a block of 256 fits, RING_BLOCK caps it
        "ring_block_256": attention_bytes(CONTEXT, "ring", seq=2048, flash_block=256),
        "ring_block_128": attention_bytes(CONTEXT, "ring", seq=2048, flash_block=128),
    }


def bench() -> dict:
    """bench/context_parallel.py's rows at 256 positions, context 8 (its 65,536-position run
    is in bench/README.md): a tiny Llama's gradient step (one layer of width 32, one timed
    step and no warm-up: the compile is most of the time), run by its ``main`` in this
    process (8 fake devices, as its own), not a second one that imports JAX again."""
    args = ["--seq", "256", "--context", "8", "--steps", "1", "--warmup", "0"]
    return bench_rows("context_parallel.py", [*args, "--layers", "1", "--width", "32"])


if __name__ == "__main__":  # one process for every mode named: JAX starts once
    modes = {"attention": attention, "train": train, "memory": memory, "bench": bench}
    print(json.dumps({mode: modes[mode]() for mode in sys.argv[1:]}))
