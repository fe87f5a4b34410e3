"""A KV cache per kind of layer: window-sized caches for the sliding-window layers, full ones
for the global layers (Gemma 2 and 3, gpt-oss's alternating windows).

Where the layers' windows differ (Gemma 3: five local layers of 1,024 positions to one global),
a cache of the generation's length on every layer keeps positions the local layers never
see again. ``KindCache`` holds one ``KvCache`` per distinct window, each with a row per layer
of that window: a window shorter than the generation keeps that many slots per layer, in the
rolling layout of ``rolling_cache`` (position ``p`` in slot ``p % w``), the others every
position. Decoding (``decode_by_kind``) scans the layers as the one-cache loop does, the
caches in the carry: each layer reads and writes its row of its kind's cache in a
``lax.switch`` branch where its window is static, so its attention is the window's size.
Generation (``models/decoding/generate.py``) prefills the prompt with the windowed kinds as
long as the prompt's bucket, then keeps their last window (``rolled``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray

from loomax.models.axes import KeyPosition
from loomax.models.blocks import offload
from loomax.models.config import KvCache, LmModel
from loomax.models.decoding.rolling_cache import to_rolling


def _named(x) -> bool:
    return isinstance(x, NamedArray)


class KindCache(eqx.Module):
    """Keys and values by kind of layer: ``caches[i]`` (a ``KvCache``, axes ``(layers, ...,
    key_position, ...)``) holds a row for each layer of window ``windows[i]``; layer ``j``
    is row ``rows[j]`` of cache ``kinds[j]``. ``length``: the positions generation may fill."""

    caches: tuple[KvCache, ...]
    windows: tuple[int | None, ...] = eqx.field(static=True)
    kinds: tuple[int, ...] = eqx.field(static=True)
    rows: tuple[int, ...] = eqx.field(static=True)
    length: int = eqx.field(static=True)

    def rolling(self, i: int) -> bool:
        """Whether cache ``i`` keeps a window shorter than ``length`` (rolling slots)."""
        return self.windows[i] is not None and self.windows[i] < self.length


def uses_kinds(model: LmModel, max_len: int) -> bool:
    """Whether ``model`` decodes ``max_len`` positions with a cache per kind of layer: its
    layers' windows differ and one of them is shorter than ``max_len``."""
    windows = model.layer_windows()
    return len(set(windows)) > 1 and any(w is not None and w < max_len for w in windows)


def init_kind_cache(
    model: LmModel, batch_axes, max_len: int, dtype, local_len: int | None = None
) -> KindCache:
    """An empty ``KindCache`` for ``max_len`` positions: the kinds whose window is shorter
    keep ``local_len`` positions (default: the window; a prefill longer than it fills a
    cache of its own length, then ``rolled``), the others ``max_len``."""
    windows = model.layer_windows()
    distinct = sorted(set(windows), key=lambda w: -1 if w is None else w)
    kinds = tuple(distinct.index(w) for w in windows)
    rows = tuple(kinds[:j].count(k) for j, k in enumerate(kinds))
    shape = jax.eval_shape(lambda: model.init_cache(batch_axes, 1, dtype))
    if not isinstance(shape, KvCache):
        raise TypeError(f"a cache per kind of layer needs a KvCache, got {type(shape).__name__}")

    def empty(x: NamedArray, layers: int, size: int) -> NamedArray:
        resized = {x.axes[0].name: layers, KeyPosition: size}
        return hax.zeros(tuple(a.resize(resized.get(a.name, a.size)) for a in x.axes), x.dtype)

    caches = []
    for i, w in enumerate(distinct):
        size = max_len if w is None or w >= max_len else (local_len or w)
        count = kinds.count(i)
        caches.append(KvCache(empty(shape.k, count, size), empty(shape.v, count, size)))
    return KindCache(tuple(caches), tuple(distinct), kinds, rows, max_len)


def rolled(cache: KindCache, length: jax.Array) -> KindCache:
    """``cache`` after a prefill of ``length`` positions from 0: each windowed kind keeps the
    last window of them in its rolling slots (``rolling_cache.to_rolling``)."""
    caches = tuple(
        to_rolling(c, length, cache.windows[i]) if cache.rolling(i) else c
        for i, c in enumerate(cache.caches)
    )
    return dataclasses.replace(cache, caches=caches)


def cache_bytes(cache) -> int:
    """Bytes held by a cache's arrays (any pytree of arrays)."""
    leaves = jax.tree.leaves(cache, is_leaf=_named)
    return sum(int(x.size) * x.dtype.itemsize for x in leaves)


def period(kinds: Sequence[int]) -> int:
    """The shortest ``p`` with ``kinds[j] == kinds[j + p]`` throughout (``len(kinds)``: none)."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if all(kinds[j] == kinds[j + p] for j in range(n - p)))


def decode_by_kind(
    x: NamedArray, stacks: Sequence[hnn.Stacked], cache: KindCache, start
) -> tuple[NamedArray, KindCache]:
    """``x`` through every block of ``stacks`` in order (their layers numbered on from 0),
    each block reading and updating its row of its kind's cache from position ``start``
    with its window static (``block.decode(x, layer_cache, start, layer, window=w)``).

    A stack's layers run as a scan over repeats of its pattern of kinds (``period``), the
    pattern's layers one after another in the loop body, then the layers left over: each
    layer's kind is static, the caches are the carry, updated in place a row at a time."""
    rows = jnp.asarray(cache.rows, jnp.int32)

    def run(x, caches, stacked, first: int, j, layer):
        """Layer ``first + layer`` (``j``: its place in the pattern, static)."""
        i, here = cache.kinds[first + j], first + layer
        block = offload.fetch(jax.tree.map(lambda w: w[w.axes[0].name, layer], stacked,
                                           is_leaf=_named))  # fmt: skip
        row, name = rows[here], caches[i].k.axes[0].name
        mine = jax.tree.map(lambda a: a[name, row], caches[i], is_leaf=_named)
        x, mine = block.decode(
            x, mine, start, jnp.asarray(here, jnp.int32), window=cache.windows[i]
        )
        new = jax.tree.map(lambda a, b: a.at[name, row].set(b), caches[i], mine, is_leaf=_named)
        return x, (*caches[:i], new, *caches[i + 1 :])

    caches, first = cache.caches, 0
    for blocks in stacks:
        n, stacked = blocks.Block.size, blocks.stacked
        p = period(cache.kinds[first : first + n])

        def repeat(carry, g, p=p, first=first, stacked=stacked):
            for j in range(p):
                carry = run(*carry, stacked, first, j, g * p + j)
            return carry, None

        (x, caches), _ = jax.lax.scan(repeat, (x, caches), jnp.arange(n // p, dtype=jnp.int32))
        for layer in range(n - n % p, n):  # the layers after the last whole repeat
            x, caches = run(x, caches, stacked, first, layer % p, layer)
        first += n
    return x, dataclasses.replace(cache, caches=caches)
