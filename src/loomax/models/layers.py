"""Running the stack of blocks: scanned (``model.scan_layers: true``) or unrolled.

The parameters are stacked on ``layers`` either way (``haliax.nn.Stacked``), so checkpoints,
HF export and every tool that reads weights see one layout. A block is called as
``block(x, segment_ids, key=..., layer=...)``: ``key`` (one per layer, split from the
step's key) only while dropout can act, ``layer`` (the block's index) only for models that
ask for it. Unrolled, each block is its own straight-line code under the same remat policy
(compile time grows with depth; no loop carries the layers' activations).

Parameters may rest in host memory (``trainer.offload_params``: the stacked blocks' arrays
in pinned host memory): the stack is then scanned by ``offload.scan``, which moves each
block's slice to the devices inside the loop, in the forward pass and again in the backward
pass (the move is part of the rematerialized block), so one layer's weights at a time
occupy device memory, and their gradients go back to host memory the same way.
"""

from __future__ import annotations

import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import PRNGKeyArray

from loomax.config import ConfigError
from loomax.models.attention import max_logits
from loomax.models.axes import Layers
from loomax.models.blocks import offload, pipeline, taps

CARRY = f"scan({Layers})__carry"
"""The checkpoint name of a layer's input (as Haliax's layer scan names it)."""
INPUT = f"scan({Layers})__input"
"""The checkpoint name of a layer's sliced inputs (its parameters, as Haliax names them)."""


def layer_inputs(
    num_layers: int, *, key: PRNGKeyArray | None = None, layer_index: bool = False
) -> dict[str, jax.Array]:
    """The per-layer arguments of the blocks, each with a leading ``layers`` dimension:
    ``key`` (split from ``key``) when given, ``layer`` (0, 1, ...) when ``layer_index``."""
    out = {}
    if key is not None:
        out["key"] = jax.random.split(key, num_layers)
    if layer_index:
        out["layer"] = jnp.arange(num_layers, dtype=jnp.int32)
    return out


def run_layers(
    blocks: hnn.Stacked,
    x: NamedArray,
    segment_ids: NamedArray | None,
    *,
    scan: bool = True,
    unroll: int | bool = 1,
    per_layer: dict[str, jax.Array] | None = None,
    first_layer: int = 0,
) -> NamedArray:
    """``x`` through every block in order; ``per_layer`` (from ``layer_inputs``) is sliced
    per block; ``first_layer`` is the model index of the stack's first block (how the
    activation statistics name its layers). With activation statistics or QK-clip's maxima
    asked for (``taps``, ``max_logits``) the blocks are scanned (all unrolled when ``scan``
    is false), since taps records them as scan outputs. A stack in host memory is scanned by
    ``offload.scan`` (not unrolled: a ``ConfigError``). Over a ``stage`` mesh axis of more
    than one device the stack runs as a pipeline (``loomax.models.blocks.pipeline``; the
    statistics go round its ring with each microbatch, GPipe's loop only)."""
    per_layer = per_layer or {}
    if pipeline.stage_count() > 1:
        if offload.any_on_host(blocks.stacked):
            raise ConfigError(
                "trainer.mesh.stage > 1: not with trainer.offload_params (a staged stack is "
                "not streamed yet)"
            )
        return pipeline.run_stages(
            blocks, x, segment_ids, unroll=unroll, per_layer=per_layer, first_layer=first_layer
        )
    if taps.active() or max_logits.active():  # per-layer outputs of the scan
        unroll = unroll if scan else True
        return taps.scan_layers(
            blocks, x, segment_ids, unroll=unroll, first_layer=first_layer, **per_layer
        )
    if scan and offload.any_on_host(blocks.stacked):
        call = lambda carry, block, *a, **kw: (block(carry, *a, **kw), None)  # noqa: E731
        remat = blocks.gradient_checkpointing
        scanned = offload.scan(call, blocks.Block, remat=remat, unroll=unroll)
        return scanned(x, blocks.stacked, segment_ids, **per_layer)[0]
    if scan:
        return blocks.fold(x, segment_ids, unroll=unroll, **per_layer)
    if offload.any_on_host(blocks.stacked):
        raise ConfigError(
            "trainer.offload_params: needs model.scan_layers true (the unrolled stack would "
            "slice host memory outside the loop)"
        )
    return _unrolled(blocks, x, segment_ids, per_layer)


def _unrolled(
    blocks: hnn.Stacked,
    x: NamedArray,
    segment_ids: NamedArray | None,
    per_layer: dict[str, jax.Array],
) -> NamedArray:
    def layer(carry, block, segment_ids, extra):
        carry = jax.tree.map(lambda a: checkpoint_name(a, CARRY), carry)
        return block(carry, segment_ids, **extra)

    call = blocks.gradient_checkpointing.checkpoint(CARRY, INPUT, layer)
    for i, block in enumerate(blocks.unstacked()):
        x = call(x, block, segment_ids, {name: v[i] for name, v in per_layer.items()})
    return x
