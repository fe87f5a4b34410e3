"""A prompt's prefill with the sequence split over the ``context`` mesh axis (long prompts).

Under the compute mapping of a mesh with ``context`` n > 1 (``position`` split), a model's
``decode`` from position 0 over the whole cache is a split prefill: the tokens are laid out
zig-zag as in training (``models/attention/sequence_layout.py``), rotary angles take each slot's true
position, and attention is the training's context-parallel attention (``ring`` or
``all_gather``, ``model.context_parallel``), so each device holds 1/n of the activations and
of the keys and values. Each layer's keys and values then go into the KV cache in true
order, split contiguously over the context axis (device j holds positions ``[jL/n,
(j+1)L/n)``): from the zig-zag layout that is two ``ppermute``s of one chunk each
(``contiguous_from_layout``), never a gather of the sequence. Decoding continues from that
cache as it lies: each step's attention reads the local 1/n of the cache on every device
and GSPMD reduces the softmax across them (a max, a sum and the output: one token's worth
per layer), so a 128k-1M-token cache is never held whole by one device.

A prompt shorter than the cache is padded after its end (``models/decoding/generate.py``): causal
masks keep the padding out of every prompt position, and a decode step writes its position's
keys and values before it attends, so no query ever sees a padded slot.
"""

from __future__ import annotations

import functools

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from loomax.config import ConfigError
from loomax.mesh import current_mesh, make_axis_mappings
from loomax.models.attention.attention import AttentionSettings, model_attention
from loomax.models.attention.sequence_layout import (
    context_axes,
    context_ways,
    layout_positions,
    to_layout,
)
from loomax.models.axes import KeyPosition, Position
from loomax.models.config import KvCache, LmModel
from loomax.runtime import MeshRuntime


def split_prefill(model: LmModel, tokens: NamedArray) -> tuple[NamedArray, KvCache]:
    """Prefill ``tokens`` (axis ``position`` in true order, as long as the cache to fill) with
    the sequence split over the context axes of the mesh in context (``context_ways() > 1``).

    Returns the final hidden states in the zig-zag layout (``hidden_at`` picks one position)
    and the KV cache in true order, split contiguously over the context axes.
    """
    Pos = tokens.resolve_axis(Position)
    ways = context_ways()
    if ways < 2:
        raise ValueError("split_prefill needs a mesh in context whose position axis is split")
    if Pos.size % (2 * ways):
        raise ConfigError(
            f"a split prefill of {Pos.size} positions needs a multiple of 2 x the context "
            f"split ({2 * ways})"
        )
    batch_axes = tuple(a for a in tokens.axes if a.name != Position)
    cache = model.init_cache(batch_axes, Pos.size, model.lm_head_weight().dtype)
    return model.decode(to_layout(tokens), cache, jnp.asarray(0, jnp.int32))


def check_splittable(model: LmModel) -> None:
    """``ConfigError`` before any compile when ``model``'s attention cannot run split: a split
    prefill is full causal attention, as training's context-parallel attention is."""
    config = getattr(model, "config", None)
    for key in ("sliding_window", "attn_logit_softcap"):
        if getattr(config, key, None) is not None:
            raise ConfigError(
                f"model.{key} is not supported when sampling with a split prompt (a mesh "
                "with context > 1; the split prefill is full causal attention): sample on a "
                "mesh without a context axis"
            )


def hidden_at(hidden: NamedArray, position: jax.Array) -> NamedArray:
    """The hidden state of true position ``position`` (traced) of zig-zag laid-out states: a
    masked sum over the split axis (an all-reduce of one vector, no gather of the sequence)."""
    mask = layout_positions(hidden.resolve_axis(Position)) == position
    return hax.sum(hax.where(mask, hidden, hax.zeros_like(hidden)), Position)


def split_prefill_attention(
    config: AttentionSettings,
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    cache_k: NamedArray,
    cache_v: NamedArray,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: NamedArray | None = None,
) -> tuple[NamedArray, NamedArray, NamedArray]:
    """A decoder layer's attention in a split prefill (``q``, ``k``, ``v`` zig-zag laid out,
    as long as the cache): the model's context-parallel attention, and the keys and values
    as the new cache (true order, split contiguously). Returns ``(out, cache_k, cache_v)``;
    a ``window`` or ``softcap`` is refused there as in training (``ConfigError``); ``sinks``
    run as there."""
    T, S = q.resolve_axis(Position).size, cache_k.resolve_axis(KeyPosition).size
    if T != S:
        raise ValueError(f"a split prefill fills the whole cache: {T} positions, cache of {S}")
    out = model_attention(config, q, k, v, window=window, scale=scale, softcap=softcap, sinks=sinks)
    return out, _as_cache(k, cache_k), _as_cache(v, cache_v)


def _as_cache(x: NamedArray, cache: NamedArray) -> NamedArray:
    """Laid-out keys or values ``x`` as ``cache`` (its axes and dtype), in true order."""
    order = tuple(Position if a.name == KeyPosition else a.name for a in cache.axes)
    dim = order.index(Position)
    array = contiguous_from_layout(x.rearrange(order).array, dim)
    return hax.named(array.astype(cache.dtype), cache.axes)


def contiguous_from_layout(x: jax.Array, dim: int) -> jax.Array:
    """``x`` (split over the context axes along ``dim``, in the zig-zag layout) in true order,
    split contiguously: device j ends with chunks 2j and 2j + 1 of the 2n.

    Device i holds chunks i and 2n - 1 - i: one even and one odd. Every even chunk 2j goes to
    device j, every odd one 2j + 1 too: two collective permutes of one chunk each."""
    mesh, axes, ways = current_mesh(), context_axes(), context_ways()
    ctx = axes[0] if len(axes) == 1 else axes
    last = 2 * ways - 1
    even_chunk = [i if i % 2 == 0 else last - i for i in range(ways)]
    to_even = [(i, even_chunk[i] // 2) for i in range(ways)]
    to_odd = [(i, (last - even_chunk[i]) // 2) for i in range(ways)]

    def local(x):
        c = x.shape[dim] // 2
        early = jax.lax.slice_in_dim(x, 0, c, axis=dim)
        late = jax.lax.slice_in_dim(x, c, 2 * c, axis=dim)
        odd_device = jax.lax.axis_index(ctx) % 2 == 1
        even, odd = jnp.where(odd_device, late, early), jnp.where(odd_device, early, late)
        even = jax.lax.ppermute(even, ctx, to_even)
        odd = jax.lax.ppermute(odd, ctx, to_odd)
        return jnp.concatenate([even, odd], axis=dim)

    spec = P(*([None] * dim), ctx)
    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(x)


def weights_mesh(model: LmModel) -> Mesh | None:
    """The mesh the model's weights lie on (the first named sharding found), if any."""
    for leaf in jax.tree.leaves(model):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def context_split(mesh: Mesh | None) -> int:
    """Devices the ``context`` axis of ``mesh`` splits a sequence over (1: none)."""
    return 1 if mesh is None else int(dict(mesh.shape).get("context", 1))


def on_mesh(model: LmModel, mesh: Mesh) -> LmModel:
    """``model`` with every weight not already on ``mesh``'s devices copied whole to each."""
    whole, devices = NamedSharding(mesh, P()), set(mesh.devices.flat)

    def place(x):
        if isinstance(x, jax.Array) and x.sharding.device_set != devices:
            return jax.device_put(x, whole)
        return x

    return jax.tree.map(place, model)


@functools.lru_cache(maxsize=8)
def prompt_prefill(mesh: Mesh):
    """``prefill(model, tokens, length) -> (cache, hidden)`` on ``mesh``: ``tokens`` (``[L]``,
    the prompt's ``length`` tokens then anything) padded to a multiple of 2 x the context
    split and prefilled split over it (``split_prefill``); ``hidden`` is the final state of
    the prompt's last position. ``model`` must lie on ``mesh`` (``on_mesh``)."""
    runtime = MeshRuntime(mesh, make_axis_mappings())
    chunks = 2 * context_split(mesh)

    @jax.jit
    def prefill(model, tokens, length):
        hidden, cache = split_prefill(model, hax.named(tokens, Position))
        return cache, hidden_at(hidden, length - 1)

    def run(model, tokens, length):
        tokens = jnp.pad(tokens, (0, -tokens.shape[0] % chunks))
        with runtime.mesh_context():
            return prefill(model, tokens, jnp.asarray(length, jnp.int32))

    return run
