"""The staged stack with the loss and an explicit backward per slot: 1F1B, interleaved 1F1B and
zero-bubble, run in one SPMD program from their schedule table.

``loomax.pipeline_schedules.table`` (every action one slot) says what each stage does in each
slot: ``F`` (its chunk's forward of a microbatch), ``B`` (the backward: ``jax.vjp`` of the
chunk at the stashed input, with the cotangent the next stage sent; input and weight
gradients, or, under ``zero_bubble``, the input gradient alone) or ``W`` (the weight
gradient, ``zero_bubble``). The last chunk's ``B`` runs the chunk and the loss's tail
(``pipeline_tail.StageTail``: final layer, head, cross-entropy) together, cotangent 1, so a
microbatch's backward starts as soon as its forward reaches the end. ``control`` turns the
table into per-slot integers (a branch code, the microbatch, the chunk, where the input and
cotangent wait, where the values arriving this slot are kept): stage inputs and cotangents
wait in buffers of the most a stage ever holds at once (about ``p`` for 1F1B, not ``m``:
what 1F1B is for), a slot reused once its backward is done. Every slot ends with two
``ppermute``s round the ring (outputs forward, input gradients backward). The backward
recomputes the chunk's forward from its input (only inputs are stashed). A mixture of
experts' router statistics do not travel: each chunk fills its own layers' rows from zeros,
and its backward differentiates its share of their losses (linear in the rows) beside the
residual stream's cotangent; the forwards' statistics are summed into the step's mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from loomax.models.blocks.pipeline_tail import StageTail
from loomax.pipeline_schedules import table
from loomax.stages import STAGE_AXIS

IDLE, FWD, BWD, BWD_TAIL, BIN, BIN_TAIL, WGT, WGT_TAIL = range(8)
"""Branch codes: idle, forward, whole backward (of the last chunk: with the tail), input
gradient alone (zero-bubble's B), weight gradient alone (its W)."""


@dataclass(frozen=True)
class Staged:
    """The stack prepared by ``pipeline.run_stages``: ``chunk(params, extra, inp, seg)`` runs
    one chunk of layers on a microbatch, ``(output, statistics)``: a mixture of experts'
    ``RouterAux`` of the chunk's layers (zeros in the other layers' rows), else None;
    ``stacked`` and ``extra`` are ``(v, p, chunk, ...)``; ``x`` and ``seg`` are
    ``(m, rows / m, ...)``; ``named(h)`` names a microbatch's array; ``stats_zeros()`` the
    statistics a chunk starts from (None without)."""

    mesh: Any
    stages: int
    microbatches: int
    virtual: int
    chunk: Callable
    stacked: list
    extra: dict
    x: jax.Array
    seg: jax.Array | None
    inner: dict
    named: Callable
    stats_zeros: Callable[[], Any] = lambda: None


def control(name: str, p: int, m: int, v: int) -> tuple[np.ndarray, int, int]:
    """``(ctrl [slots, p, 7], input buffers, cotangent buffers)``: per slot and stage the
    branch code, microbatch, chunk, input buffer (-1: the stack's input), cotangent buffer
    (-1: the tail's), and the buffers this slot's arriving output and cotangent go to (-1: none)."""
    split = name == "zero_bubble"
    slots = table(name, p, m, v, backward_slots=1).slots
    when = {}
    for t, row in enumerate(slots):
        for s, a in enumerate(row):
            if a is not None:
                when[(a.kind, s, a.microbatch, a.chunk)] = t
    last = "W" if split else "B"
    arrivals: dict[str, list[list]] = {"F": [[] for _ in range(p)], "B": [[] for _ in range(p)]}
    for (kind, s, mb, c), t in when.items():
        if kind == "F":
            dst, dc = (s + 1) % p, c + (s == p - 1)
            ok = dc < v
        elif kind == "B":
            dst, dc = (s - 1) % p, c - (s == 0)
            ok = dc >= 0
        else:
            continue
        if ok:
            arrivals[kind][dst].append((t + 1, when[(last, dst, mb, dc)], mb, dc))
    where: dict[str, dict] = {"F": {}, "B": {}}
    sizes = {}
    for kind, per_stage in arrivals.items():
        sizes[kind] = 1
        for s, spans in enumerate(per_stage):
            ends: list[int] = []  # last use of each buffer
            for start, end, mb, c in sorted(spans):
                free = [i for i, e in enumerate(ends) if e < start]
                i = free[0] if free else len(ends)
                ends[i:i + 1] = [end]  # fmt: skip
                where[kind][(s, mb, c)] = (i, start)
            sizes[kind] = max(sizes[kind], len(ends))
    ctrl = np.full((len(slots), p, 7), -1, np.int32)
    ctrl[:, :, :3] = 0
    for kind, col in (("F", 5), ("B", 6)):
        for (s, _, _), (i, start) in where[kind].items():
            if start < len(slots):
                ctrl[start, s, col] = i
    for t, row in enumerate(slots):
        for s, a in enumerate(row):
            if a is None:
                continue
            tail = s == p - 1 and a.chunk == v - 1
            code = {"F": FWD, "B": BIN if split else BWD, "W": WGT}[a.kind] + (
                tail and a.kind != "F"
            )
            inp = -1 if (s == 0 and a.chunk == 0) else where["F"][(s, a.microbatch, a.chunk)][0]
            cot = -1 if tail or a.kind == "F" else where["B"][(s, a.microbatch, a.chunk)][0]
            ctrl[t, s, :5] = (code, a.microbatch, a.chunk, inp, cot)
    return ctrl, sizes["F"], sizes["B"]


def run(staged: Staged, name: str, tail: StageTail, rows: list[jax.Array]):
    """``(loss, stack gradients, input gradient, tail gradients, statistics)``: the
    cross-entropy summed over microbatches; the gradients of the stacked arrays
    ``(v, p, chunk, ...)``, of the stack input ``(m, rows / m, ...)`` and of the tail's params;
    the statistics' mean over the microbatches (None without). With statistics and a
    ``tail.aux_loss``, every backward also differentiates its chunk's share of the
    microbatch's statistics' losses, ``tokens / m x aux_loss(chunk statistics)`` (linear in
    the statistics, so the chunks' shares add up); their value is left to the model, which
    adds it from the mean statistics (as without stages)."""
    p, m, v = staged.stages, staged.microbatches, staged.virtual
    ctrl, n_in, n_cot = control(name, p, m, v)
    codes = sorted(set(ctrl[..., 0].ravel().tolist()))  # only these branches are compiled
    branch_of = np.zeros(WGT_TAIL + 1, np.int32)
    branch_of[codes] = np.arange(len(codes))
    fwd_ring = [(i, (i + 1) % p) for i in range(p)]
    bwd_ring = [(i, (i - 1) % p) for i in range(p)]

    def body(params, extra, x_mb, seg_mb, tail_params, t_mb, w_mb):
        s = jax.lax.axis_index(STAGE_AXIS)
        params = [a[:, 0] for a in params]  # (v, chunk, ...): this stage's chunks
        extra = {k: a[:, 0] for k, a in extra.items()}
        rows_s = jnp.asarray(ctrl)[:, s]  # (slots, 7)
        zero = jnp.zeros_like(x_mb[0])
        zeros_tail = jax.tree.map(jnp.zeros_like, tail_params)
        zeros_stats = staged.stats_zeros()
        scale = jnp.sum(w_mb).astype(jnp.float32) / m  # the statistics' losses: token means

        def share(stats) -> jax.Array:  # a chunk's part of its microbatch's statistics' losses
            if stats is None or tail.aux_loss is None:
                return jnp.zeros((), jnp.float32)
            return scale * tail.aux_loss(stats).astype(jnp.float32)

        def slot(carry, row):
            recv_f, recv_b, acts, cots, g_params, g_tail, dx, loss, stats_sum = carry
            code, mb, c, i_in, i_cot, w_act, w_cot = (row[i] for i in range(7))
            acts = _keep(acts, w_act, recv_f)
            cots = _keep(cots, w_cot, recv_b)
            inp = jnp.where(i_in < 0, x_mb[mb], acts[jnp.maximum(i_in, 0)])
            cot = (cots[jnp.maximum(i_cot, 0)], jnp.ones((), jnp.float32))
            p_c = [a[c] for a in params]
            e_c = {k: a[c] for k, a in extra.items()}
            seg = None if seg_mb is None else seg_mb[mb]
            t_r, w_r = t_mb[mb], w_mb[mb]

            def f(pc, h):  # (output, its statistics' losses' share)
                y, stats = staged.chunk(pc, e_c, h, seg)
                return y, share(stats)

            def ft(pc, tp, h):  # (what the backward differentiates, the cross-entropy)
                y, aux_part = f(pc, h)
                with hax.axis_mapping(staged.inner):
                    ce = tail.fn(tp, staged.named(y), t_r, w_r).astype(jnp.float32)
                return ce + aux_part, ce

            zp = [jnp.zeros_like(a) for a in p_c]
            nil = jnp.zeros((), jnp.float32)
            one = jnp.ones((), jnp.float32)

            def idle():
                return zero, zero, zp, zeros_tail, nil, zeros_stats

            def forward():
                y, stats = staged.chunk(p_c, e_c, inp, seg)
                return y, zero, zp, zeros_tail, nil, stats

            def backward():
                _, vjp = jax.vjp(f, p_c, inp)
                dp, dh = vjp(cot)
                return zero, dh, dp, zeros_tail, nil, zeros_stats

            def backward_tail():
                _, vjp, ce = jax.vjp(ft, p_c, tail_params, inp, has_aux=True)
                dp, dt, dh = vjp(one)
                return zero, dh, dp, dt, ce, zeros_stats

            def input_grad():
                _, vjp = jax.vjp(lambda h: f(p_c, h), inp)
                return zero, vjp(cot)[0], zp, zeros_tail, nil, zeros_stats

            def input_grad_tail():
                _, vjp, ce = jax.vjp(lambda h: ft(p_c, tail_params, h), inp, has_aux=True)
                return zero, vjp(one)[0], zp, zeros_tail, ce, zeros_stats

            def weight_grad():
                _, vjp = jax.vjp(lambda pc: f(pc, inp), p_c)
                return zero, zero, vjp(cot)[0], zeros_tail, nil, zeros_stats

            def weight_grad_tail():
                _, vjp, _ = jax.vjp(lambda pc, tp: ft(pc, tp, inp), p_c, tail_params, has_aux=True)
                dp, dt = vjp(one)
                return zero, zero, dp, dt, nil, zeros_stats

            branches = [idle, forward, backward, backward_tail, input_grad, input_grad_tail]
            branches += [weight_grad, weight_grad_tail]
            index = jnp.asarray(branch_of)[code]
            used = [branches[c] for c in codes]
            send_f, send_b, dp, dt, loss_mb, stats = jax.lax.switch(index, used)
            g_params = [g.at[c].add(d.astype(g.dtype)) for g, d in zip(g_params, dp, strict=True)]
            g_tail = jax.tree.map(lambda g, d: g + d.astype(g.dtype), g_tail, dt)
            stats_sum = jax.tree.map(jnp.add, stats_sum, stats)
            first = (s == 0) & (c == 0) & ((code == BWD) | (code == BIN))
            dx = dx.at[mb].set(jnp.where(first, send_b, dx[mb]))
            recv_f = jax.lax.ppermute(send_f, STAGE_AXIS, fwd_ring)
            recv_b = jax.lax.ppermute(send_b, STAGE_AXIS, bwd_ring)
            carry = (recv_f, recv_b, acts, cots, g_params, g_tail, dx, loss + loss_mb, stats_sum)
            return carry, None

        acts = jnp.zeros((n_in, *zero.shape), zero.dtype)
        cots = jnp.zeros((n_cot, *zero.shape), zero.dtype)
        g_params = [jnp.zeros_like(a) for a in params]
        carry = (zero, zero, acts, cots, g_params, zeros_tail, jnp.zeros_like(x_mb))
        carry += (jnp.zeros(()), zeros_stats)
        (*_, g_params, g_tail, dx, loss, stats_sum), _ = jax.lax.scan(slot, carry, rows_s)
        total = jax.lax.psum(loss, STAGE_AXIS)
        g_tail = jax.lax.psum(g_tail, STAGE_AXIS)  # the last stage's; zeros elsewhere
        dx = jax.lax.psum(dx, STAGE_AXIS)  # the first stage's
        # every stage's chunks fill their layers' rows (zeros elsewhere) of every microbatch
        stats = jax.tree.map(lambda a: jax.lax.psum(a, STAGE_AXIS) / m, stats_sum)
        return total, [g[:, None] for g in g_params], dx, g_tail, stats

    stage_spec = [P(None, STAGE_AXIS)] * len(staged.stacked)
    extra_spec = {k: P(None, STAGE_AXIS) for k in staged.extra}
    loop = jax.shard_map(
        body,
        mesh=staged.mesh,
        in_specs=(stage_spec, extra_spec, P(), P(), P(), P(), P()),
        out_specs=(P(), stage_spec, P(), P(), P()),
        axis_names={STAGE_AXIS},
        check_vma=False,
    )
    sg = jax.lax.stop_gradient
    args = (staged.stacked, staged.extra, staged.x, staged.seg, tail.params, *rows)
    return loop(*sg(args))


def _keep(buffers: jax.Array, index: jax.Array, value: jax.Array) -> jax.Array:
    """``buffers`` with ``value`` at ``index`` (unchanged when ``index`` is -1)."""
    i = jnp.maximum(index, 0)
    return buffers.at[i].set(jnp.where(index >= 0, value, buffers[i]))
