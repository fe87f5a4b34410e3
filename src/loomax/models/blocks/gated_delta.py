"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3-Next's linear attention).

Per head, a state ``S [dk, dv]`` decays by ``exp(g_t)``, then takes the delta rule's
correction toward ``v_t`` along ``k_t`` with strength ``beta_t``, and answers ``q_t``:

    S_t = exp(g_t) S_{t-1};  S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T q_t

``recurrent_gated_delta`` runs it a step at a time (a ``lax.scan``: the reference, and
decoding's one step, ``gated_delta_step``); ``chunked_gated_delta`` is the training form:
chunks of ``chunk`` positions, each chunk's updates gathered in the WY representation (the
unit lower-triangular system ``(I + L) T = I`` of the chunk's keys, solved once, so a chunk
is a few ``[chunk, chunk]`` and ``[chunk, d]`` matmuls) and the state carried from chunk to
chunk: O(T chunk d + T d^2) work, matmul-shaped, against the recurrence's T serial steps.

Documents: ``reset [B, T]`` (true at each document's first position) zeroes the state there,
so packed documents never see each other; in the chunked form a same-document mask inside
each chunk and a "no reset since the chunk began" factor on the carried state do it, with no
infinite gates (whose differences would be NaN).

Shapes: ``q``, ``k`` ``[B, T, H, dk]``, ``v`` ``[B, T, H, dv]``, ``g`` (log decay, <= 0) and
``beta`` ``[B, T, H]``; the state ``[B, H, dk, dv]``. Queries are used as given (the layer
scales and normalises them). The layer around it (short convolutions, output gate and norm,
Qwen3-Next's projections) is not in this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gated_delta_step(state, q, k, v, g, beta, reset=None):
    """One position: ``(state, o)`` from ``state [B, H, dk, dv]`` and ``q``/``k`` ``[B, H, dk]``,
    ``v [B, H, dv]``, ``g``/``beta`` ``[B, H]``; ``reset [B]`` zeroes the state first."""
    decay = jnp.exp(g)
    if reset is not None:
        decay = jnp.where(reset[:, None], 0.0, decay)
    state = state * decay[..., None, None]
    seen = jnp.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - seen) * beta[..., None]
    state = state + jnp.einsum("bhk,bhv->bhkv", k, delta)
    return state, jnp.einsum("bhkv,bhk->bhv", state, q)


def recurrent_gated_delta(q, k, v, g, beta, reset=None, state=None):
    """``(out [B, T, H, dv], final state)``: the rule a position at a time."""
    B, T, H, dk = q.shape
    if state is None:
        state = jnp.zeros((B, H, dk, v.shape[-1]), q.dtype)
    if reset is None:
        reset = jnp.zeros((B, T), bool)

    def step(state, xs):
        return gated_delta_step(state, *xs)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, reset))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def chunked_gated_delta(q, k, v, g, beta, chunk: int, reset=None, state=None):
    """``(out [B, T, H, dv], final state)``: the rule by chunks of ``chunk`` positions (the
    sequence padded to a multiple with positions that change nothing)."""
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    if state is None:
        state = jnp.zeros((B, H, dk, dv), q.dtype)
    if reset is None:
        reset = jnp.zeros((B, T), bool)
    pad = (-T) % chunk
    n = (T + pad) // chunk

    def blocks(a):  # [B, T, H, ...] -> [n, B, H, chunk, ...], padded with zeros (no change)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(B, n, chunk, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 2, 3)

    qc, kc, vc = blocks(q), blocks(k), blocks(v)
    gc, bc = blocks(g), blocks(beta)  # [n, B, H, chunk]
    doc = jnp.cumsum(jnp.pad(reset, [(0, 0), (0, pad)]).astype(jnp.int32), axis=1)
    doc = jnp.moveaxis(doc.reshape(B, n, chunk), 1, 0)[:, :, None]  # [n, B, 1, chunk]
    first = jnp.moveaxis(jnp.pad(reset, [(0, 0), (0, pad)]).reshape(B, n, chunk), 1, 0)

    def per_chunk(state, xs):
        q, k, v, g, beta, doc, first = xs
        g = jnp.cumsum(g, axis=-1)  # the decay from the chunk's start, inclusive
        same = doc[..., :, None] == doc[..., None, :]  # [B, 1, C, C]
        lower = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
        causal = jnp.tril(jnp.ones((chunk, chunk), bool))
        gap = jnp.where(causal & same, g[..., :, None] - g[..., None, :], -jnp.inf)
        decay = jnp.exp(gap)  # [B, H, C, C]: exp(g_i - g_j), j <= i in i's document
        # the carried state reaches position i unless a document began in the chunk by i
        fresh = (jnp.cumsum(first.astype(jnp.int32), axis=-1) == 0)[:, None]  # [B, 1, C]
        carry = jnp.where(fresh, jnp.exp(g), 0.0)  # [B, H, C]
        kb, vb = k * beta[..., None], v * beta[..., None]
        lmat = jnp.where(lower, jnp.einsum("bhid,bhjd->bhij", kb, k) * decay, 0.0)
        eye = jnp.eye(chunk, dtype=q.dtype)
        wy = jax.scipy.linalg.solve_triangular(eye + lmat, jnp.broadcast_to(eye, lmat.shape),
                                               lower=True, unit_diagonal=True)  # fmt: skip
        u = wy @ vb  # the chunk's corrections, the carried state aside
        w = wy @ (kb * carry[..., None])  # how the carried state enters them
        new = u - w @ state  # [B, H, C, dv]
        scores = jnp.where(causal, jnp.einsum("bhid,bhjd->bhij", q, k) * decay, 0.0)
        out = (q * carry[..., None]) @ state + scores @ new
        last = jnp.where(same[..., -1, :], jnp.exp(g[..., -1:] - g), 0.0)  # [B, H, C]
        state = state * carry[..., -1, None, None] + jnp.einsum("bhc,bhck,bhcv->bhkv", last, k, new)
        return state, out

    state, out = jax.lax.scan(per_chunk, state, (qc, kc, vc, gc, bc, doc, first))
    out = jnp.moveaxis(out, 0, 1)  # [B, n, H, C, dv]
    out = jnp.moveaxis(out, 3, 2).reshape(B, n * chunk, H, dv)
    return out[:, :T], state
