"""Layer remat: which activations a layer keeps for the backward pass, and which it recomputes.

``model.gradient_checkpointing`` picks the policy of the layer scan; ``model.remat_save``
and ``model.remat_offload`` name activations inside a layer to keep on the device or in
host memory instead of recomputing them (JAX's ``save_and_offload_only_these_names``).
Models mark those activations with ``name_activation``.
"""

from __future__ import annotations

from collections.abc import Sequence

import haliax as hax
import jax
from jax.ad_checkpoint import checkpoint_name

from loomax.config import ConfigError
from loomax.models.attention.ring_attention import RING_RESIDUALS
from loomax.models.attention.splash import SPLASH_RESIDUALS

REMAT_POLICIES = (True, False, "offload", "nested", "recompute", "save_all")
"""Values of ``model.gradient_checkpointing`` (see docs/models.md)."""

ACTIVATIONS = {
    "qkv": "the query, key and value projections (after rotary)",
    "attn_out": "attention's output, before the output projection",
    SPLASH_RESIDUALS: "the splash kernel's output and log-sum-exp: with attn_out, no kernel rerun",
    RING_RESIDUALS: "ring attention's output and log-sum-exp: no ring forward in the backward",
    "mlp_in": "the MLP's input: the normed residual stream after attention",
    "mlp_up": "the MLP's up (and gate) projections, before the activation: its widest matmuls",
    "moe_up": "expert parallelism's gate and up projections of the routed rows "
    "(model.moe.saved_rows of them): no experts' forward in the backward",
    "moe_out": "expert parallelism's expert outputs back home, before the routing weights",
}
"""Names ``model.remat_save`` / ``model.remat_offload`` accept, and what each is."""

_NAMED_BASES = (True, "offload", "recompute")


def name_activation(x, name: str):
    """``x`` (an array or a tree of them) marked with checkpoint name ``name``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation name {name!r}; known: {sorted(ACTIVATIONS)}")
    return jax.tree.map(lambda a: checkpoint_name(a, name), x)


def check_remat(policy: bool | str, save: Sequence[str], offload: Sequence[str]) -> None:
    """Raise ``ConfigError`` naming the key for a policy or activation name that cannot work."""
    if policy not in REMAT_POLICIES:
        raise ConfigError(
            f"model.gradient_checkpointing must be one of {list(REMAT_POLICIES)}, got {policy!r}"
        )
    for key, names in (("remat_save", save), ("remat_offload", offload)):
        unknown = [n for n in names if n not in ACTIVATIONS]
        if unknown:
            raise ConfigError(
                f"model.{key}: unknown activation(s) {unknown}; known: {sorted(ACTIVATIONS)}"
            )
        if names and policy not in _NAMED_BASES:
            raise ConfigError(
                f"model.{key} needs model.gradient_checkpointing true, offload or recompute "
                f"(got {policy!r}: it saves everything or nests the scan)"
            )
    both = sorted(set(save) & set(offload))
    if both:
        raise ConfigError(f"model.remat_save and model.remat_offload both name {both}")


def scan_policy(
    policy: bool | str, save: Sequence[str] = (), offload: Sequence[str] = ()
) -> hax.ScanCheckpointPolicy:
    """The Haliax policy of the layer scan for these settings (checked by ``check_remat``).

    ``offload`` moves each layer's input (the scan carry) to pinned host memory and
    recomputes the layer's parameter slices; Haliax's own ``offload`` also offloads those
    slices, which libtpu's compiler cannot lower for sharded parameters (a CHECK failure in
    ``async_slice_util``), and which are in memory anyway.
    """
    check_remat(policy, save, offload)
    if policy in _NAMED_BASES:
        carries = {True: True, "offload": "offload", "recompute": False}[policy]
        if policy is True and not save and not offload:
            return hax.ScanCheckpointPolicy(simple=True)
        return hax.ScanCheckpointPolicy(
            save_carries=carries,
            save_inputs=False,
            save_block_internals=tuple(save),  # tuples: the policy is hashed as a static field
            offload_block_internals=tuple(offload),
        )
    return hax.ScanCheckpointPolicy.from_bool_or_str(policy)
