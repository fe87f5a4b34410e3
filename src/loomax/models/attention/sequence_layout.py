"""Where each position of a sequence split over the ``context`` mesh axis lives.

Under context parallelism (``position`` mapped to mesh axes of size n > 1 in the compute
mapping) the sequence is laid out zig-zag for causal load balance: cut into 2n chunks,
device i holds chunks i and 2n-1-i, so every device has as many early as late queries.
The model works in this layout throughout: ``next_token_loss`` puts the tokens, document
ids, targets and weights into it (``to_layout``), rotary angles and attention masks use
``layout_positions`` (each slot's true position), and nothing is put back: the loss is a
sum over tokens. With one device on the axis the layout is the identity.

``token_positions`` is what rotary angles and learned position tables read: the true
positions, or with ``model.document_positions`` each packed document's own (from 0 at its
first token), so a document packed at any offset is computed as it would be alone.
"""

from __future__ import annotations

import math

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray

from loomax.config import ConfigError
from loomax.mesh import current_mesh
from loomax.models.axes import Position


def context_axes() -> tuple[str, ...]:
    """The mesh axes the compute mapping in context splits ``position`` over (of size > 1
    in the mesh in context); () when the sequence is whole on every device."""
    mesh = current_mesh()
    target = (hax.partitioning.current_thread_local_mapping() or {}).get(Position)
    if mesh is None or target is None:
        return ()
    names = (target,) if isinstance(target, str) else tuple(target)
    return names if math.prod(mesh.shape[n] for n in names) > 1 else ()


def context_ways() -> int:
    """Devices each sequence is split over (1: not split)."""
    mesh = current_mesh()
    return math.prod(mesh.shape[n] for n in context_axes()) if mesh is not None else 1


def check_split(seq_len: int, ways: int) -> None:
    """Raise ``ConfigError`` unless ``seq_len`` cuts into the 2 x ``ways`` zig-zag chunks."""
    if ways > 1 and seq_len % (2 * ways):
        raise ConfigError(
            f"model.seq_len ({seq_len}) must be a multiple of 2 x trainer.mesh.context "
            f"({2 * ways}) to split each sequence into zig-zag chunks"
        )


def zigzag_order(seq_len: int, ways: int) -> np.ndarray:
    """The true position held at each slot of the layout (``[seq_len]``, a permutation):
    device i's slots hold chunks i and 2 x ``ways`` - 1 - i, in order."""
    check_split(seq_len, ways)
    chunks = np.arange(seq_len).reshape(2 * ways, -1)
    order = [np.concatenate([chunks[i], chunks[2 * ways - 1 - i]]) for i in range(ways)]
    return np.concatenate(order)


def layout_positions(Pos: Axis) -> NamedArray:
    """The true position of each slot of a ``Pos``-long sequence as laid out here (int32)."""
    ways = context_ways()
    if ways == 1:
        return hax.arange(Pos)
    return hax.named(jnp.asarray(zigzag_order(Pos.size, ways), jnp.int32), Pos)


def to_layout(x: NamedArray) -> NamedArray:
    """``x`` (with a ``position`` axis in true order) in the layout (the identity unsplit)."""
    Pos = x.resolve_axis(Position)
    ways = context_ways()
    if ways == 1:
        return x
    order = jnp.asarray(zigzag_order(Pos.size, ways), jnp.int32)
    return hax.auto_sharded(x.take(Pos, hax.named(order, Pos)))


def from_layout(x: NamedArray) -> NamedArray:
    """``x`` (with a ``position`` axis in the layout) back in true order (``to_layout``'s inverse)."""
    Pos = x.resolve_axis(Position)
    ways = context_ways()
    if ways == 1:
        return x
    slots = jnp.asarray(np.argsort(zigzag_order(Pos.size, ways)), jnp.int32)
    return x.take(Pos, hax.named(slots, Pos))


def document_positions(segment_ids: NamedArray) -> NamedArray:
    """Each slot's position within its document (int32, axes of ``segment_ids``, in the
    layout): 0 where the document id changes from the previous true position, counting up
    from there. Documents are contiguous runs of one id (packed rows, ``segment_ids_from_eos``)."""
    seg = from_layout(segment_ids).rearrange((..., Position))
    ids = seg.array
    index = jnp.arange(ids.shape[-1], dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones((*ids.shape[:-1], 1), bool), ids[..., 1:] != ids[..., :-1]], axis=-1
    )
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=ids.ndim - 1)
    return to_layout(hax.named(index - first, seg.axes))


def token_positions(Pos: Axis, segment_ids: NamedArray | None, restart: bool | None) -> NamedArray:
    """The positions rotary and position tables use: per document (``document_positions``)
    when ``restart`` and ``segment_ids`` are given, else each slot's true position."""
    if restart and segment_ids is not None:
        return document_positions(segment_ids)
    return layout_positions(Pos)
