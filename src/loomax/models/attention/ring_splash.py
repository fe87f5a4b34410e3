"""The zig-zag ring (``models/attention/ring_attention.py``) with a splash kernel per chunk pair (TPU).

The same static schedule as the blockwise ring: device i holds chunks i and 2n-1-i; with its
own keys it runs the two causal diagonals and its late chunk over its early one; each of the
n - 1 hops two all-visible pairs (both query chunks over the visiting early chunk if it
comes from an earlier device, else the late query chunk over both visiting chunks: one
``lax.cond``). Each pair is one splash call with its log-sum-exp (``models/attention/splash_pair.py``:
two kernels, causal and all-visible, built once); the partial outputs are combined by their
log-sum-exps in float32. The custom backward sends the blocks round again, their dK/dV
partial sums one hop behind, and runs splash's dq/dkv kernels per pair, fed the whole
ring's log-sum-exp and ``D = rowsum(dO * O)``, as flash attention's ring backward does.

Each hop overlaps the kernels, as the blockwise ring's (``models/attention/ring_attention.py``): the
chunks in hand are sent on before they are attended to, a device's share of a chunk
pair's dK/dV is computed while the previous device's partial sum for it is in flight
(then added), the last sums go home over the late diagonal, and a hop is one
collective-permute (``models/attention/ring_hops.py``). On every platform (no CPU variant: the
interpret-mode CPU runs check this schedule's values).

Chunks must suit splash's blocks (``splash_unsupported_reason`` of the chunk length).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from loomax.models.attention.ring_hops import add_partials, ring_hop
from loomax.models.attention.splash_pair import SplashPair


class _Config(NamedTuple):
    """The static side of one ring (hashable: ``custom_vjp``'s non-differentiable argument)."""

    heads: int
    length: int  # positions of a zig-zag chunk
    block_q: int
    block_kv: int
    interpret: bool
    axis: Any
    ways: int
    residual_name: str


def splash_ring_attention(
    q, k, v, pos, seg, *, scale: float, blocks: tuple[int, int], axis, ways: int,
    interpret: bool, residual_name: str,
):  # fmt: skip
    """This device's queries ``[b, K, G, T, D]`` over every device's keys and values
    ``[b, K, T, D]`` around the ring of ``ways`` devices of ``axis`` (inside ``shard_map``;
    ``pos``/``seg`` the local slots' true positions and document ids, zig-zag layout).
    ``blocks`` are splash's query and key blocks (at most a chunk); the output and log-sum-exp
    carry the checkpoint name ``residual_name``."""
    b, K, G, T, D = q.shape
    qh = (q * np.asarray(scale, q.dtype)).reshape(b, K * G, T, D)
    c = T // 2
    bq, bkv = (min(x, c) for x in blocks)
    config = _Config(K * G, c, bq, bkv, interpret, axis, ways, residual_name)
    out = _ring(qh, k, v, pos, seg, config)
    return out.reshape(b, K, G, T, D)


def _pairs(config: _Config) -> tuple[SplashPair, SplashPair]:
    """The (all-visible, causal) kernels."""
    shape = (config.heads, config.length, config.block_q, config.block_kv)
    return tuple(SplashPair(*shape, causal, config.interpret) for causal in (False, True))


def _halves(x, dim: int):
    """``x``'s early and late chunks along ``dim``."""
    c = x.shape[dim] // 2
    return tuple(jax.lax.slice_in_dim(x, s, s + c, axis=dim) for s in (0, c))


def _split(q, k, v, pos, seg):
    """The query chunks ``(q, seg)`` and key chunks ``(k, v, seg, first position)``, early
    and late."""
    qs, ks, vs, segs, ps = (
        _halves(q, 2),
        _halves(k, 2),
        _halves(v, 2),
        _halves(seg, 1),
        _halves(pos, 0),
    )
    queries = tuple(zip(qs, segs, strict=True))
    keys = tuple((kk, vv, s, p[0]) for kk, vv, s, p in zip(ks, vs, segs, ps, strict=True))
    return queries, keys


def _earlier(held, own) -> jax.Array:
    """Whether the ``held`` chunks come from a device before this one (module docstring)."""
    return held[0][3] < own[0][3]


def _merge(a, b):
    """Two partial (output, log-sum-exp) of the same queries, combined (float32)."""
    (oa, la), (ob, lb) = a, b
    lse = jnp.logaddexp(la, lb)
    return oa * jnp.exp(la - lse)[..., None] + ob * jnp.exp(lb - lse)[..., None], lse


def _where(flag, a, b):
    return jax.tree.map(lambda x, y: jnp.where(flag, x, y), a, b)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, pos, seg, config):
    return _forward(q, k, v, pos, seg, config)[0]


def _forward(q, k, v, pos, seg, config):
    full, causal = _pairs(config)
    axis, ways = config.axis, config.ways
    (qe, ql), own = _split(q, k, v, pos, seg)

    def run(kernel, queries, keys):
        (qc, qs), (kk, vv, ks, _) = queries, keys
        out, lse = kernel.forward(qc, kk, vv, qs, ks)
        return out.astype(jnp.float32), lse

    hop = partial(ring_hop, axis=axis, ways=ways)
    held = hop(own) if ways > 1 else None  # in flight over the diagonals
    state_e = run(causal, qe, own[0])
    state_l = _merge(run(causal, ql, own[1]), run(full, ql, own[0]))

    def visit(states, held):
        se, sl = states
        sl = _merge(sl, run(full, ql, held[0]))
        earlier = _earlier(held, own)
        x = jax.lax.cond(earlier, lambda: run(full, qe, held[0]), lambda: run(full, ql, held[1]))
        return _where(earlier, _merge(se, x), se), _where(earlier, sl, _merge(sl, x))

    def step(carry, _):
        states, held = carry
        sent = hop(held)  # the next hop's chunks, in flight while these are attended to
        return (visit(states, held), sent), None

    states = (state_e, state_l)
    if ways > 2:
        (states, held), _ = jax.lax.scan(step, (states, held), None, length=ways - 2)
    if ways > 1:
        states = visit(states, held)  # the last chunks: nothing left to send
    se, sl = states
    out = jnp.concatenate([se[0], sl[0]], axis=2).astype(q.dtype)
    return out, jnp.concatenate([se[1], sl[1]], axis=2)


def _fwd(q, k, v, pos, seg, config):
    out, lse = _forward(q, k, v, pos, seg, config)
    name = config.residual_name
    out, lse = checkpoint_name(out, name), checkpoint_name(lse, name)
    return out, (q, k, v, pos, seg, out, lse)


def _bwd(config, residuals, g):
    q, k, v, pos, seg, out, lse = residuals
    full, causal = _pairs(config)
    axis, ways = config.axis, config.ways
    f32 = jnp.float32
    di = jnp.sum(g.astype(f32) * out.astype(f32), axis=-1)
    (qe, ql), own = _split(q, k, v, pos, seg)
    ge, gl = zip(_halves(lse, 2), _halves(g.astype(q.dtype), 2), _halves(di, 2), strict=True)

    def run(kernel, queries, grads, keys):
        qc, qs = queries
        kk, vv, ks, _ = keys
        lse_c, do, di_c = grads
        dq, dk, dv = kernel.backward(qc, kk, vv, qs, ks, lse_c, do, di_c)
        return dq.astype(f32), (dk.astype(f32), dv.astype(f32))

    def add(a, b):
        return jax.tree.map(jnp.add, a, b)

    hop = partial(ring_hop, axis=axis, ways=ways)
    held = hop(own) if ways > 1 else None  # in flight over the early diagonal
    dq_e, dkv_ee = run(causal, qe, ge, own[0])
    dq_l, dkv_le = run(full, ql, gl, own[0])
    no_late = jax.tree.map(jnp.zeros_like, dkv_le)  # our late chunk's share comes last
    partial_sum = (add(dkv_ee, dkv_le), no_late)

    def visit(dqs, held):
        """This device's share of the ``held`` chunks' dK/dV, and its dQ."""
        dq_e, dq_l = dqs
        dq_x, dkv_x = run(full, ql, gl, held[0])
        dq_l = dq_l + dq_x

        def early_keys():
            dq, dkv = run(full, qe, ge, held[0])
            return (dq_e + dq, dq_l), (add(dkv_x, dkv), jax.tree.map(jnp.zeros_like, dkv))

        def late_queries():
            dq, dkv = run(full, ql, gl, held[1])
            return (dq_e, dq_l + dq), (dkv_x, dkv)

        return jax.lax.cond(_earlier(held, own), early_keys, late_queries)

    def ring_step(dqs, held, sending, pass_on: bool):
        """One hop, overlapped: ``held`` passed on (unless the last) with ``sending``, the
        partial sum of the chunks held before; the held chunks' sum arrives meanwhile."""
        passed, arrived = hop((held if pass_on else None, sending))
        dqs, mine = visit(dqs, held)
        return dqs, passed, add_partials(mine, arrived)

    def step(carry, _):
        return ring_step(*carry, True), None

    dqs = (dq_e, dq_l)
    if ways > 2:  # a loop also for one hop (see models/attention/ring_attention.py's backward)
        carry = (dqs, held, partial_sum)
        (dqs, held, partial_sum), _ = jax.lax.scan(step, carry, None, length=ways - 2)
    if ways > 1:
        dqs, _, partial_sum = ring_step(dqs, held, partial_sum, False)
        partial_sum = hop(partial_sum)  # the last partial sums, home over our late diagonal
    dq_ll, dkv_ll = run(causal, ql, gl, own[1])
    dq_e, dq_l = dqs[0], dqs[1] + dq_ll
    (dk_e, dv_e), (dk_l, dv_l) = add_partials(partial_sum, (None, dkv_ll))
    dq = jnp.concatenate([dq_e, dq_l], axis=2)  # of the scaled queries: the caller's chain rule
    dk, dv = jnp.concatenate([dk_e, dk_l], axis=2), jnp.concatenate([dv_e, dv_l], axis=2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_fwd, _bwd)
