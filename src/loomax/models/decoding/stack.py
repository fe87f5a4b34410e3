"""The one decode loop every family runs: its blocks over the KV cache, a step at a time.

``decode_layers`` takes the hidden states of the tokens being decoded (one step, or a whole
prompt at prefill) through every stack of blocks in order, each stack scanned
(``offload.scan``) over its slice of the cache's leading ``layers`` axis. Every block decodes
with ``block.decode(x, layer_cache, start[, layer])``. A family supplies its embedding before
and its final norm after; the stacks are ``LmModel.decode_stacks`` (Mixtral with dense first
layers has two: the dense blocks, then the MoE blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray

from loomax.models.blocks import offload
from loomax.models.decoding.kind_cache import KindCache, decode_by_kind

Cache = TypeVar("Cache")


def _named(x) -> bool:
    return isinstance(x, NamedArray)


def decode_layers(
    x: NamedArray,
    stacks: Sequence[hnn.Stacked],
    cache: Cache,
    start,
    *,
    layer_index: bool = False,
) -> tuple[NamedArray, Cache]:
    """``x`` through every block of ``stacks`` in order, each block reading and updating its
    layer of ``cache`` from position ``start``; ``layer_index``: each block is also given its
    model layer number (an int32 scalar: per-layer windows, GPT-2's inverse-layer scaling).
    Returns the last block's output and the updated cache. A ``KindCache`` (a cache per
    kind of layer) goes through ``kind_cache.decode_by_kind``."""
    if isinstance(cache, KindCache):
        return decode_by_kind(x, stacks, cache, start)
    name = jax.tree.leaves(cache, is_leaf=_named)[0].axes[0].name
    first, parts = 0, []
    for blocks in stacks:
        n = blocks.Block.size
        part = cache
        if len(stacks) > 1:
            where = slice(first, first + n)
            part = jax.tree.map(lambda a, w=where: a[name, w], cache, is_leaf=_named)
        index = [jnp.arange(first, first + n, dtype=jnp.int32)] if layer_index else []

        def step(x, block, layer_cache, *layer):
            return block.decode(x, layer_cache, start, *layer)

        x, part = offload.scan(step, blocks.Block)(x, blocks.stacked, part, *index)
        parts.append(part)
        first += n
    if len(parts) == 1:
        return x, parts[0]
    return x, jax.tree.map(lambda *a: hax.concatenate(name, a), *parts, is_leaf=_named)
