"""Activation statistics taken inside the jitted step, on the steps that ask for them.

While a ``collect()`` block is open (at trace time: the train step opens one on the steps
an ``activations`` hook asks for), ``tap(name, x)`` records the mean, standard deviation,
largest magnitude, RMS and the fraction of near-zero values of ``x``; outside one it does
nothing, so the ordinary step traces exactly as before and costs nothing more. The layer
stack is scanned, so ``scan_layers`` runs each block under its own ``collect()`` and
returns the statistics as the scan's outputs (one value per layer), recorded as
``layer_<i>/<name>/<stat>``. The loss records the logits' (``logits``) block by block, as
the fused cross-entropy never holds them whole. Statistics of a sharded activation are
global (XLA reduces across devices).
"""

from __future__ import annotations

import contextlib
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp

from loomax.models.attention import max_logits
from loomax.models.blocks import offload
from loomax.trace_frames import FrameStack

STATS = ("mean", "std", "absmax", "rms", "near_zero")
"""What ``tap`` records of an activation."""

NEAR_ZERO = 1e-3
"""A value is near zero when its magnitude is below this fraction of the tensor's RMS."""

_FRAMES = FrameStack()


def active() -> bool:
    """Whether a ``collect()`` block is open (statistics are being taken)."""
    return _FRAMES.active()


def collect():
    """Open a collection: ``tap`` calls inside it record into the dict yielded
    (``{name: {stat: value}}``; ``scan_layers`` adds ``layer_<i>/<name>``)."""
    return _FRAMES.open()


def stats_of(x) -> dict[str, jax.Array]:
    """``STATS`` of array (or ``NamedArray``) ``x`` as float32 scalars."""
    a = (x.array if isinstance(x, hax.NamedArray) else x).astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(a * a))
    return {
        "mean": jnp.mean(a),
        "std": jnp.std(a),
        "absmax": jnp.max(jnp.abs(a)),
        "rms": rms,
        "near_zero": jnp.mean((jnp.abs(a) < NEAR_ZERO * rms).astype(jnp.float32)),
    }


def tap(name: str, x):
    """``x``, its statistics recorded under ``name`` if a collection is open."""
    frame = _FRAMES.innermost()
    if frame is not None:
        frame[name] = stats_of(x)
    return x


def record(name: str, stats: dict[str, jax.Array]) -> None:
    """Record ``STATS`` computed elsewhere (e.g. of logits that never exist whole) under
    ``name``, if a collection is open."""
    frame = _FRAMES.innermost()
    if frame is not None:
        frame[name] = stats


def scan_recording(blocks: hax.nn.Stacked, x, *args, unroll: int | bool | None = None, **kwargs):
    """``blocks.fold(x, *args)`` and what each layer recorded: ``(out, per_layer, seen)``,
    ``per_layer`` ``{name: {stat: (layers,)}}`` (what the blocks tap and the residual stream
    after each block) while a ``collect()`` is open, ``seen`` ``{max_logits.ATTN: (layers,
    heads)}`` while a ``max_logits.collecting()`` is. Records nothing itself."""
    tapping, peaks = active(), max_logits.active()

    def layer(carry, block, *extra, **kw):
        frame = collect() if tapping else contextlib.nullcontext({})
        peak_frame = max_logits.collecting() if peaks else contextlib.nullcontext({})
        with frame as recorded, peak_frame as seen:
            out = block(carry, *extra, **kw)
            tap("residual", out[0] if isinstance(out, tuple) else out)  # (x, aux): MoE
        return out, (recorded, seen)

    size = blocks.Block.size
    steps = size if unroll is True else 1 if unroll in (None, False) else int(unroll)
    out, (per_layer, seen) = offload.scan(
        layer, blocks.Block, remat=blocks.gradient_checkpointing, unroll=steps
    )(x, blocks.stacked, *args, **kwargs)
    return out, per_layer, seen


def record_layers(per_layer: dict, seen: dict, first_layer: int, size: int) -> None:
    """Record a stack's per-layer statistics (``scan_recording``'s ``per_layer`` and
    ``seen``, rows per layer) into the open frames as ``layer_<i>/<name>`` and under
    ``max_logits.stack_key(first_layer)``."""
    if max_logits.ATTN in seen:
        max_logits.record(max_logits.stack_key(first_layer), seen[max_logits.ATTN])
    frame = _FRAMES.innermost()
    if frame is not None:
        width = len(str(first_layer + size - 1))
        for name, stats in per_layer.items():
            for i in range(size):
                where = f"layer_{first_layer + i:0{width}d}/{name}"
                frame[where] = {k: v[i] for k, v in stats.items()}


def scan_layers(
    blocks: hax.nn.Stacked,
    x,
    *args,
    unroll: int | bool | None = None,
    first_layer: int = 0,
    **kwargs,
):
    """``blocks.fold(x, *args)`` that also records, per layer, what the blocks tap and the
    residual stream after each block (``layer_<i>/<name>/<stat>``, ``i`` counted from
    ``first_layer``: a model with two stacks names them in model order), when a ``collect()``
    is open, and the attention's per-head maximum logits (``(layers, heads)`` under
    ``max_logits.stack_key(first_layer)``), when a ``max_logits.collecting()`` is. Same remat
    policy; a stack in host memory is fetched a layer at a time (``offload.scan``)."""
    out, per_layer, seen = scan_recording(blocks, x, *args, unroll=unroll, **kwargs)
    record_layers(per_layer, seen, first_layer, blocks.Block.size)
    return out


def combine_microbatches(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``STATS`` of a whole batch from its equal microbatches' (leading axis: microbatch):
    the mean of means, the standard deviation and RMS from the mean squares, the largest
    magnitude, and the mean of the near-zero fractions (each microbatch's threshold from its
    own RMS: the one approximate figure)."""
    mean = jnp.mean(stats["mean"], axis=0)
    square = jnp.mean(stats["std"] ** 2 + stats["mean"] ** 2, axis=0)
    return {
        "mean": mean,
        "std": jnp.sqrt(jnp.maximum(square - mean**2, 0.0)),
        "absmax": jnp.max(stats["absmax"], axis=0),
        "rms": jnp.sqrt(jnp.mean(stats["rms"] ** 2, axis=0)),
        "near_zero": jnp.mean(stats["near_zero"], axis=0),
    }


def flatten(recorded: dict[str, Any], prefix: str = "activations") -> dict[str, jax.Array]:
    """``{prefix/<where>/<stat>: value}`` of what a ``collect()`` recorded."""
    return {
        f"{prefix}/{where}/{stat}": value
        for where, stats in recorded.items()
        for stat, value in stats.items()
    }
