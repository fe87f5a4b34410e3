"""The layer stack run as a pipeline over the ``stage`` mesh axis, in one SPMD program.

The stacked layers (leading ``layers`` dimension, resting on ``stage``: ``layers -> stage``)
are cut into ``stages x virtual_stages`` equal chunks; device ``s`` of a stage group holds
chunks ``s, s + stages, ...`` (one chunk per device for ``gpipe``: the contiguous layers the
parameter mapping already gives it). The batch is split into the pipeline's microbatches
(row ``i`` of each ``microbatches`` rows, as the step's accumulation splits it) and a
``jax.shard_map`` manual over ``stage`` alone (the other axes stay automatic, so data, FSDP
and tensor parallelism inside a stage keep their shardings) runs a static schedule: at slot
``t`` stage ``s`` runs work item ``t - s`` (microbatch ``item % m`` through chunk
``item // m``), then ``jax.lax.ppermute`` passes every stage's output to the next, the last
stage's back to the first (which keeps it until that microbatch's next chunk is due). Idle
slots run on zeros whose results nothing reads: the bubble, ``(p - 1) / (v m + p - 1)`` of
the slots. The backward pass is JAX's transpose of the loop (the cotangents pass the other
way round the ring), so gradients are those of the unstaged stack and accumulate per stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import PartitionSpec as P

from loomax.config import ConfigError
from loomax.mesh import current_mesh
from loomax.models.attention import max_logits
from loomax.models.blocks import pipeline_explicit, pipeline_tail, taps
from loomax.stages import (
    LOSS_IN_LOOP_SCHEDULES,
    STAGE_AXIS,
    PipelineConfig,
    current_pipeline,
)


def stage_count() -> int:
    """Devices of the ``stage`` axis of the mesh in context (1 without one)."""
    mesh = current_mesh()
    if mesh is None or STAGE_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[STAGE_AXIS])


def stack_input(embed: Callable[[NamedArray], NamedArray], tokens: NamedArray) -> NamedArray:
    """``embed(tokens)``, sharded by the compute mapping in context; over stages, whole on every
    stage of a data shard (``batch`` split over the data axes, not ``stage``), as the staged
    stack reads it anyway. The lookup's backward, a scatter-add of the shard's rows into the
    embedding's gradient (and an embedding norm's, summed over the rows), then adds the same
    rows in the same order at any stage count: split over ``data x stage`` it summed each
    device's rows, then the devices', and the gradient's last bits followed the stage count.
    It costs each stage the data shard's gather and scatter-add (no matmul)."""
    if stage_count() == 1:
        return hax.auto_sharded(embed(tokens))
    mapping = hax.partitioning.current_thread_local_mapping() or {}
    with hax.axis_mapping(_without_stage(mapping)):
        return hax.auto_sharded(embed(hax.auto_sharded(tokens)))


def pipeline_plan(layers: int, rows: int, stages: int, config: PipelineConfig) -> tuple[int, int]:
    """``(microbatches, virtual_stages)`` for a stack of ``layers`` over ``stages`` and a batch
    of ``rows``; a ``ConfigError`` naming the keys when they do not divide."""
    v, m = config.virtual_stages, config.microbatches_for(stages)
    if layers % (stages * v):
        raise ConfigError(
            f"trainer.mesh.stage ({stages}) x trainer.pipeline.virtual_stages ({v}) must divide "
            f"the model's {layers} layers"
        )
    if rows % m:
        raise ConfigError(
            f"trainer.pipeline.microbatches ({m}) must divide the batch's {rows} rows per "
            "forward pass (train_batch_size / per_device_parallelism microbatches)"
        )
    if v > 1 and m < stages:
        raise ConfigError(
            f"trainer.pipeline.microbatches ({m}) must be at least trainer.mesh.stage ({stages}) "
            "for the interleaved schedule"
        )
    if config.schedule == "interleaved_1f1b" and m % stages:
        raise ConfigError(
            f"trainer.pipeline.microbatches ({m}) must be a multiple of trainer.mesh.stage "
            f"({stages}) for interleaved_1f1b"
        )
    return m, v


def bubble(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of the staged loop's slots: ``(p - 1) / (v m + p - 1)``."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def run_stages(
    blocks: hnn.Stacked,
    x: NamedArray | tuple,
    segment_ids: NamedArray | None,
    *,
    unroll: int | bool = 1,
    per_layer: dict[str, jax.Array] | None = None,
    first_layer: int = 0,
) -> NamedArray | tuple:
    """``x`` through every block of ``blocks``, pipelined over the ``stage`` mesh axis. ``x``
    may be ``(residual, statistics)`` (a mixture of experts' ``RouterAux``, rows per layer):
    each microbatch's statistics go round with its residual stream, and the result's are
    their mean over the microbatches. Activation statistics and QK-clip's maxima (``taps``,
    ``max_logits``, asked for) travel the same way, rows per layer, each chunk filling its
    own layers' rows; the whole batch's are recorded (``taps.combine_microbatches``, the
    largest maxima), layers named from ``first_layer``. ``gpipe`` only."""
    mesh, p = current_mesh(), stage_count()
    aux0 = None
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], NamedArray):
        x, aux0 = x
    if not isinstance(x, NamedArray):
        raise ConfigError(
            "trainer.mesh.stage > 1: this model's layers carry more than the residual stream "
            "and its statistics; its stack is not staged yet"
        )
    Batch = x.axes[0]
    L = blocks.Block.size
    m, v = pipeline_plan(L, Batch.size, p, current_pipeline())
    chunk = L // (p * v)
    per_layer = per_layer or {}

    leaves, treedef = jax.tree.flatten(blocks.stacked, is_leaf=lambda a: isinstance(a, NamedArray))
    where = [i for i, a in enumerate(leaves) if isinstance(a, NamedArray) or eqx.is_array(a)]
    named = [leaves[i] for i in where]
    names = [tuple(ax.name for ax in a.axes) if isinstance(a, NamedArray) else None for a in named]
    raw = [a.array if isinstance(a, NamedArray) else a for a in named]

    def by_chunk(a):  # (layers, ...) -> (v, p, chunk, ...): chunk r*p + s on stage s
        return a.reshape(v, p, chunk, *a.shape[1:])

    stacked_in = [by_chunk(a) for a in raw]
    layer_in = {k: by_chunk(a) for k, a in per_layer.items()}

    def micro(a):  # (rows, ...) -> (m, rows / m, ...): microbatch i = rows i, i + m, ...
        return a.reshape(-1, m, *a.shape[1:]).swapaxes(0, 1)

    x_axes = tuple(ax.name for ax in x.axes)
    x_in = micro(x.array)
    seg_axes = None if segment_ids is None else tuple(ax.name for ax in segment_ids.axes)
    seg_in = None if segment_ids is None else micro(segment_ids.array)
    Micro = Batch.resize(Batch.size // m)

    inner = _without_stage(hax.partitioning.current_thread_local_mapping() or {})
    recording = taps.active() or max_logits.active()
    peak_axes = []  # the maxima's axis names, found when the chunk is traced

    def stage_chunk(params, extra, inp, seg, first=None):  # inp: (residual, statistics)
        local_leaves = list(leaves)
        for i, a, n in zip(where, params, names, strict=True):
            local_leaves[i] = a if n is None else hax.named(a, n)
        local = jax.tree.unflatten(treedef, local_leaves)
        stack = dataclasses.replace(blocks, stacked=local, Block=blocks.Block.resize(chunk))
        h = hax.named(inp[0], (Micro.name, *x_axes[1:]))
        s_ids = None if seg is None else hax.named(seg, (Micro.name, *seg_axes[1:]))
        if first is not None:  # recording: inp[1] is (statistics, rows per model layer)
            return _recorded_chunk(stack, h, inp[1], s_ids, extra, first)
        with hax.axis_mapping(inner):  # stage is manual in here: no constraint may name it
            out = stack.fold(h if aux0 is None else (h, inp[1]), s_ids, unroll=unroll, **extra)
        return (out.array, None) if aux0 is None else (out[0].array, out[1])

    def _recorded_chunk(stack, h, stats, s_ids, extra, first):
        moe, rows = stats
        with hax.axis_mapping(inner):
            out, acts, seen = taps.scan_recording(
                stack, h if moe is None else (h, moe), s_ids, unroll=unroll, **extra
            )
        peaks = seen.get(max_logits.ATTN)
        if peaks is not None and not peak_axes:
            peak_axes.append(tuple(ax.name for ax in peaks.axes))
        mine = (acts, None if peaks is None else peaks.array)
        if rows is not None:  # this chunk's layers' rows, from model layer ``first`` on
            put = jax.lax.dynamic_update_slice_in_dim
            mine = jax.tree.map(lambda full, part: put(full, part, first, 0), rows, mine)
        return (out.array, (None, mine)) if moe is None else (out[0].array, (out[1], mine))

    tail = pipeline_tail.current_tail()
    if tail is not None and current_pipeline().schedule in LOSS_IN_LOOP_SCHEDULES:
        if recording:
            raise ConfigError(
                f"trainer.pipeline.schedule {current_pipeline().schedule!r}: not with "
                "activation statistics or QK-clip (optimizer.qk_clip_tau) yet; use gpipe"
            )
        if tail.loss is not None:
            raise ConfigError(
                f"trainer.pipeline.schedule {current_pipeline().schedule!r}: this model runs "
                "more than one staged stack (the loss inside the loop needs one); use gpipe"
            )

        def stats_zeros():  # each chunk fills its own layers' rows of a microbatch's statistics
            return _map(lambda a: jnp.zeros(a.shape, a.dtype), aux0)

        def chunk_fn(params, extra, inp, seg):
            return stage_chunk(params, extra, (inp, stats_zeros()), seg)

        staged = pipeline_explicit.Staged(
            mesh, p, m, v, chunk_fn, stacked_in, layer_in, x_in, seg_in, inner,
            lambda a: hax.named(a, (Micro.name, *x_axes[1:])), stats_zeros,
        )  # fmt: skip
        loss, g_stack, g_x, g_tail, stats = pipeline_explicit.run(
            staged, current_pipeline().schedule, tail, [micro(tail.targets), micro(tail.weights)]
        )
        g_stack = [g.reshape(a.shape) for g, a in zip(g_stack, raw, strict=True)]
        g_x = g_x.swapaxes(0, 1).reshape(x.array.shape)
        pairs = [(raw, g_stack), (x.array, g_x), (tail.params, g_tail)]
        tail.loss = pipeline_tail.surrogate(loss, pairs)
        # the model's forward pass goes on to hidden states the loss does not read; the
        # statistics (their mean over the microbatches) carry values only: their losses'
        # gradients are in the loop's
        return x if aux0 is None else (x, stats)

    items, slots = v * m, v * m + p - 1
    ring = [(i, (i + 1) % p) for i in range(p)]

    def body(params, extra, x_mb, seg_mb, aux_in):
        s = jax.lax.axis_index(STAGE_AXIS)
        params = [a[:, 0] for a in params]  # (v, chunk, ...): this stage's chunks
        extra = {k: a[:, 0] for k, a in extra.items()}
        if recording:  # rows per model layer, zero until each chunk fills its own
            seg0 = None if seg_mb is None else seg_mb[0]
            probe = jax.eval_shape(
                lambda p_, e_, x_, a_, g_: stage_chunk(p_, e_, (x_, (a_, None)), g_, first=0),
                [a[0] for a in params], {k: a[0] for k, a in extra.items()}, x_mb[0], aux_in, seg0,
            )  # fmt: skip
            rows = jax.tree.map(lambda a: jnp.zeros((L, *a.shape[1:]), a.dtype), probe[1][1])
            aux_in = (aux_in, rows)
        zero = (jnp.zeros_like(x_mb[0]), _map(jnp.zeros_like, aux_in))

        def pick(cond, a, b):
            return _map(lambda u, w: jnp.where(cond, u, w), a, b)

        def slot(carry, t):
            state, kept, outputs = carry
            item = jnp.clip(t - s, 0, items - 1)
            mb, r = item % m, item // m
            start = (x_mb[mb], aux_in)
            first = start if v == 1 else pick(r == 0, start, _map(lambda a: a[mb], kept))
            inp = pick(s == 0, first, state)
            chunk_params = [a[r] for a in params]
            chunk_extra = {k: a[r] for k, a in extra.items()}
            seg = None if seg_mb is None else seg_mb[mb]
            first = (r * p + s) * chunk if recording else None
            y = stage_chunk(chunk_params, chunk_extra, inp, seg, first=first)
            done = (t - s >= 0) & (t - s < items) & (s == p - 1) & (r == v - 1)
            outputs = _map(lambda o, a: o.at[mb].set(jnp.where(done, a, o[mb])), outputs, y)
            sent = jax.lax.ppermute(y, STAGE_AXIS, ring)
            if v > 1:  # stage 0 keeps what comes round the ring for the microbatch's next chunk
                back = t - (p - 1)
                keep = (s == 0) & (back >= 0) & (back < items - m)
                i = jnp.clip(back, 0, items - 1) % m
                kept = _map(lambda k, a: k.at[i].set(jnp.where(keep, a, k[i])), kept, sent)
            return (sent, kept, outputs), None

        outputs = _map(lambda a: jnp.zeros((m, *a.shape), a.dtype), zero)
        kept = outputs if v > 1 else None
        carry = (zero, kept, outputs)
        (_, _, outputs), _ = jax.lax.scan(slot, carry, jnp.arange(slots))
        return jax.lax.psum(_map(lambda a: jnp.where(s == p - 1, a, 0), outputs), STAGE_AXIS)

    stage_spec = [P(None, STAGE_AXIS)] * len(stacked_in)
    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(stage_spec, {k: P(None, STAGE_AXIS) for k in layer_in}, P(), P(), P()),
        out_specs=P(),
        axis_names={STAGE_AXIS},
        check_vma=False,
    )
    out, aux = run(stacked_in, layer_in, x_in, seg_in, aux0)
    if tail is not None and aux0 is None:  # the loss after the loop, microbatches over stages
        rows = [micro(tail.targets), micro(tail.weights)]
        named = lambda a: hax.named(a, (Micro.name, *x_axes[1:]))  # noqa: E731
        loss, g_tail, g_out = pipeline_tail.after_loop(tail, mesh, p, out, rows, inner, named)
        tail.loss = pipeline_tail.surrogate(loss, [(out, g_out), (tail.params, g_tail)])
    out = hax.auto_sharded(hax.named(out.swapaxes(0, 1).reshape(x.array.shape), x_axes))
    if recording:
        aux, (acts, peaks) = aux
        acts = {name: taps.combine_microbatches(st) for name, st in acts.items()}
        seen = {}
        if peaks is not None:
            seen[max_logits.ATTN] = hax.named(jnp.max(peaks, axis=0), peak_axes[0])
        taps.record_layers(acts, seen, first_layer, L)
    return out if aux0 is None else (out, _map(lambda a: jnp.mean(a, axis=0), aux))


def _map(fn, *trees):
    """``jax.tree.map`` that leaves a None tree None."""
    return None if trees[0] is None else jax.tree.map(fn, *trees)


def _without_stage(mapping: dict) -> dict:
    """``mapping`` with the ``stage`` mesh axis taken out of every target."""
    out = {}
    for name, target in mapping.items():
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        kept = tuple(t for t in targets if t != STAGE_AXIS)
        if kept:
            out[name] = kept[0] if len(kept) == 1 else kept
    return out
