"""The zig-zag ring (``models/ring_attention.py``) with a splash kernel per chunk pair (TPU).

The same static schedule as the blockwise ring: device i holds chunks i and 2n-1-i; with its
own keys it runs the two causal diagonals and its late chunk over its early one; each of the
n - 1 hops two all-visible pairs (both query chunks over the visiting early chunk if it
comes from an earlier device, else the late query chunk over both visiting chunks: one
``lax.cond``). Each pair is one splash call with its log-sum-exp (``models/splash_pair.py``:
two kernels, causal and all-visible, built once); the partial outputs are combined by their
log-sum-exps in float32. The custom backward sends the blocks round again with their dK/dV
and runs splash's dq/dkv kernels per pair, fed the whole ring's log-sum-exp and
``D = rowsum(dO * O)``, as flash attention's ring backward does.

Chunks must suit splash's blocks (``splash_unsupported_reason`` of the chunk length).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from loomax.models.splash_pair import SplashPair


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


def _hop(tree, axis, ways: int):
    """Every device's ``tree`` to the next device of the ring."""
    return jax.lax.ppermute(tree, axis, [(i, (i + 1) % ways) for i in range(ways)])


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

    state_e = run(causal, qe, own[0])
    state_l = _merge(run(causal, ql, own[1]), run(full, ql, own[0]))

    def step(carry, _):
        (se, sl), held = carry
        held = _hop(held, axis, ways)
        sl = _merge(sl, run(full, ql, held[0]))
        earlier = _earlier(held, own)
        x = jax.lax.cond(earlier, lambda: run(full, qe, held[0]), lambda: run(full, ql, held[1]))
        se, sl = _where(earlier, _merge(se, x), se), _where(earlier, sl, _merge(sl, x))
        return ((se, sl), held), None

    ((se, sl), _), _ = jax.lax.scan(step, ((state_e, state_l), own), None, length=ways - 1)
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

    dq_e, dkv_ee = run(causal, qe, ge, own[0])
    dq_l, dkv_le = run(full, ql, gl, own[0])
    dq_ll, dkv_ll = run(causal, ql, gl, own[1])
    dq_l = dq_l + dq_ll
    grads = (add(dkv_ee, dkv_le), dkv_ll)

    def step(carry, _):
        (dq_e, dq_l), held, grads = carry
        held, grads = _hop((held, grads), axis, ways)  # a chunk travels with its dK/dV
        dq_x, dkv_x = run(full, ql, gl, held[0])
        dq_l = dq_l + dq_x
        grads = (add(grads[0], dkv_x), grads[1])

        def early_keys():
            dq, dkv = run(full, qe, ge, held[0])
            return (dq_e + dq, dq_l), (add(grads[0], dkv), grads[1])

        def late_queries():
            dq, dkv = run(full, ql, gl, held[1])
            return (dq_e, dq_l + dq), (grads[0], add(grads[1], dkv))

        dqs, grads = jax.lax.cond(_earlier(held, own), early_keys, late_queries)
        return (dqs, held, grads), None

    carry = ((dq_e, dq_l), own, grads)
    ((dq_e, dq_l), _, grads), _ = jax.lax.scan(step, carry, None, length=ways - 1)
    (dk_e, dv_e), (dk_l, dv_l) = _hop(grads, axis, ways)  # the last hop brings them home
    dq = jnp.concatenate([dq_e, dq_l], axis=2)  # of the scaled queries: the caller's chain rule
    dk, dv = jnp.concatenate([dk_e, dk_l], axis=2), jnp.concatenate([dv_e, dv_l], axis=2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_fwd, _bwd)
