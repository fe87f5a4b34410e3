"""One hop of a ring (``models/attention/ring_attention.py``, ``models/attention/ring_splash.py``): every
device's blocks to the next device, in one collective-permute; and the dK/dV partial sums
that travel behind them, added chunk by chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ring_hop(tree, axis, ways: int, pack: bool = True):
    """Every device's ``tree`` to the next device of the ring, in one transfer: the leaves
    packed into one flat buffer (``_pack``), so that a hop is one collective-permute for
    XLA's scheduler to place around the work it hides behind. (Sent leaf by leaf, eight to
    twelve collective-permutes a hop, the v5p program overlapped one of a hop's and left the
    rest back to back.)"""
    leaves, treedef = jax.tree.flatten(tree)
    pairs = [(i, (i + 1) % ways) for i in range(ways)]
    if not pack:
        return jax.lax.ppermute(tree, axis, pairs)
    moved = jax.lax.ppermute(_pack(leaves), axis, pairs)
    return jax.tree.unflatten(treedef, _unpack(moved, leaves))


def _as(x, dtype) -> jax.Array:
    """``x`` flat, bit for bit in elements of ``dtype`` (zero-padded to whole elements)."""
    x = x.reshape(-1)
    if x.dtype == dtype:
        return x
    wide, narrow = x.dtype.itemsize, jnp.dtype(dtype).itemsize
    if wide < narrow:  # several of x's elements to one
        x = jnp.pad(x, (0, -x.size % (narrow // wide))).reshape(-1, narrow // wide)
    return jax.lax.bitcast_convert_type(x, dtype).reshape(-1)


def _pack(leaves) -> jax.Array:
    """The arrays ``leaves`` in one flat buffer of the first one's dtype (the others bit for
    bit): the keys and values travel as they are, only the small or late-needed leaves
    (positions, documents, dK/dV partial sums) are reinterpreted. (As 32-bit words, the
    keys' and values' unpacking was real work on a TPU, which XLA fused across hops into
    one fusion: a hop's attention then waited for the next hop's transfer.)"""
    carrier = leaves[0].dtype
    return jnp.concatenate([_as(x, carrier) for x in leaves])


def _unpack(packed, like) -> list[jax.Array]:
    """``_pack``'s buffer back into arrays of the shapes and dtypes of ``like``."""
    carrier = packed.dtype
    out, start = [], 0
    for x in like:
        ratio = x.dtype.itemsize / carrier.itemsize
        size = x.size * int(ratio) if ratio >= 1 else -(-x.size // int(1 / ratio))
        part = jax.lax.slice_in_dim(packed, start, start + size)
        start += size
        if x.dtype != carrier:
            part = _from(part, x.dtype, x.size)
        out.append(part.reshape(x.shape))
    return out


def _from(part, dtype, size: int) -> jax.Array:
    """``_as`` undone: ``size`` elements of ``dtype`` from ``part``."""
    wide, narrow = jnp.dtype(dtype).itemsize, part.dtype.itemsize
    if wide > narrow:
        part = part.reshape(-1, wide // narrow)
    return jax.lax.bitcast_convert_type(part, dtype).reshape(-1)[:size]


def add_partials(a, b):
    """Two partial sums ``(early, late)`` of the same chunks' dK/dV added, chunk by chunk;
    ``None`` (no share of that chunk yet) adds nothing."""

    def add(x, y):
        return y if x is None else x if y is None else jax.tree.map(jnp.add, x, y)

    return tuple(add(x, y) for x, y in zip(a, b, strict=True))
