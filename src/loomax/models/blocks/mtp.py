"""Multi-token prediction (DeepSeek-V3, Gloeckle et al. 2024): D sequential modules, depth d
predicting the token d + 1 positions ahead.

Depth d takes the previous depth's hidden states ``h`` (the main model's residual stream,
before its final norm, for d = 1) and the embeddings of the tokens d positions ahead:
``h' = block(proj([rms(h); rms(embed(t[i + d]))]))``, then a final RMSNorm and the model's own
LM head (shared) give the logits of ``t[i + d + 1]``. Each depth's loss is the mean
cross-entropy over the positions whose target lies inside the sequence. The family runs its
own transformer block (``run_block``); the modules are trained but not decoded or exported.
With MoE blocks (``moe_runner``) each depth's expert load joins the state statistics
(``mtp_moe_load``) and its routing bias moves as the main stack's does (``with_bias_moved``).
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from loomax.config import ConfigError
from loomax.models.attention import max_logits
from loomax.models.attention.sequence_layout import context_ways
from loomax.models.axes import Embed, Position
from loomax.models.blocks.norms import rms_norm
from loomax.models.config import AuxOutputs
from loomax.models.moe.moe_routing import RouterAux

MTP_LOAD = "mtp_moe_load"
"""State statistic: each depth's mean expert load ``[depths, experts]`` (``moe_runner``)."""
MtpIn = "mtp_in"
"""Axis of the concatenated normed hidden state and next-token embedding (2 x embed)."""


class MtpDepth(eqx.Module):
    """One depth: the two input norms, the projection of their concatenation, a transformer
    block and the final norm before the shared head."""

    hidden_norm: hnn.RmsNorm
    embed_norm: hnn.RmsNorm
    proj: hnn.Linear  # mtp_in (2 x embed) -> embed
    block: eqx.Module
    norm: hnn.RmsNorm

    @staticmethod
    def init(Embed_: Axis, eps: float, block: eqx.Module, *, key) -> MtpDepth:
        In = Axis(MtpIn, 2 * Embed_.size)
        proj = hnn.Linear.init(In, Embed_, key=key, use_bias=False)
        return MtpDepth(rms_norm(Embed_, eps), rms_norm(Embed_, eps), proj, block, rms_norm(Embed_, eps))  # fmt: skip


def shifted(tokens: NamedArray, by: int) -> tuple[NamedArray, NamedArray]:
    """``(tokens[i + by], valid)`` along ``position``: the token ``by`` positions ahead (the
    last one past the end) and whether it is inside the sequence."""
    P = tokens.resolve_axis(Position)
    index = hax.arange(P) + by
    valid = index < P.size
    ahead = tokens.array.take(jnp.minimum(index.array, P.size - 1), axis=tokens.axes.index(P))
    return hax.named(ahead, tokens.axes), valid.broadcast_axis(tuple(a for a in tokens.axes if a != P))  # fmt: skip


class MultiTokenPrediction(eqx.Module):
    """``depths[d - 1]`` predicts the token d + 1 positions ahead."""

    depths: tuple[MtpDepth, ...]

    @staticmethod
    def init(
        depth: int, Embed_: Axis, eps: float, make_block: Callable, *, key
    ) -> MultiTokenPrediction:
        """``depth`` modules, each block made by ``make_block(key)``."""
        keys = jax.random.split(key, 2 * depth)
        return MultiTokenPrediction(
            tuple(
                MtpDepth.init(Embed_, eps, make_block(kb), key=kp)
                for kb, kp in zip(keys[::2], keys[1::2], strict=True)
            )
        )

    def losses(
        self,
        hidden: NamedArray,
        tokens: NamedArray,
        embed: Callable[[NamedArray], NamedArray],
        head: NamedArray,
        run_block: Callable[[eqx.Module, NamedArray], NamedArray],
        segment_ids: NamedArray | None = None,
    ) -> list[jax.Array]:
        """Each depth's mean next-(d + 1) token cross-entropy, from ``hidden`` (the main
        model's residual stream, ``(..., position, embed)``) and ``tokens``; ``embed`` and
        ``head`` (``(vocab, embed)``) are the model's; ``run_block(block, x)`` runs a depth's
        block. Refused with the sequence split over ``context`` (targets are shifted along
        the whole sequence)."""
        if context_ways() > 1:
            raise ConfigError(
                "model.mtp_depth > 0 is not supported with trainer.mesh.context > 1 "
                "(its targets are shifted along the whole sequence)"
            )
        out, h = [], hidden
        w = head.rearrange(("vocab", Embed)).array
        order = (*(a.name for a in hidden.axes if a.name not in (Position, Embed)), Position)
        for d, depth in enumerate(self.depths, start=1):
            ahead, _ = shifted(tokens, d)
            target, valid = shifted(tokens, d + 1)
            parts = [depth.hidden_norm(h), depth.embed_norm(embed(ahead))]
            both = hax.concatenate(MtpIn, [p.rename({Embed: MtpIn}) for p in parts])
            h = _run_recorded(f"mtp_{d}", run_block, depth.block, depth.proj(both))
            x = depth.norm(h).rearrange((*order, Embed)).array
            logits = jnp.einsum(
                "...d,vd->...v", x, w.astype(x.dtype), preferred_element_type=jnp.float32
            )
            t = target.rearrange(order).array
            lse = jax.nn.logsumexp(logits, axis=-1)
            picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
            m = valid.rearrange(order).array.astype(jnp.float32)
            if segment_ids is not None:  # the target in the same document as the position
                same, _ = shifted(segment_ids, d + 1)
                m = m * (same.rearrange(order).array == segment_ids.rearrange(order).array)
            out.append(jnp.sum((lse - picked) * m) / jnp.maximum(jnp.sum(m), 1.0))
        return out

    def qk_clip_attention(self, get: Callable) -> dict[str, Callable]:
        """``{mtp_<d>: getter of depth d's attention}`` (QK-clip), ``get(model)`` being this."""
        return {f"mtp_{d}": lambda m, i=d - 1: get(m).depths[i].block.attn for d in range(1, len(self.depths) + 1)}  # fmt: skip

    def with_bias_moved(self, load: jax.Array, rate: float) -> MultiTokenPrediction:
        """The depths' MoE routing bias after a step whose mean expert load was ``load``
        ``[depths, experts]``: up by ``rate`` under the mean load, down over it (as the main
        stack's, ``MixtralLmModel.update_state``)."""
        step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        depths = []
        for d, depth in enumerate(self.depths):
            value = depth.block.mlp.bias.value
            new = hax.named(value.array + (rate * step[d]).astype(value.dtype), value.axes)
            depths.append(eqx.tree_at(lambda x: x.block.mlp.bias.value, depth, new))
        return MultiTokenPrediction(tuple(depths))


def moe_runner(num_experts: int, segment_ids: NamedArray | None) -> tuple[Callable, list]:
    """``(run_block, loads)``: ``run_block(block, h)`` runs an MoE block (carry ``(x,
    RouterAux)``) and appends its expert load ``[experts]`` to ``loads``."""
    loads: list[jax.Array] = []

    def run_block(block: eqx.Module, h: NamedArray) -> NamedArray:
        out, aux = block((h, RouterAux.zeros(1, num_experts)), segment_ids)
        loads.append(aux.load[0])
        return out

    return run_block, loads


def _run_recorded(name: str, run_block: Callable, block: eqx.Module, x: NamedArray) -> NamedArray:
    """``run_block(block, x)``, its attention's maximum logits (QK-clip) recorded as ``name``."""
    if not max_logits.active():
        return run_block(block, x)
    with max_logits.collecting() as seen:
        out = run_block(block, x)
    if max_logits.ATTN in seen:
        max_logits.record(name, seen[max_logits.ATTN])
    return out


def with_mtp_losses(
    aux: AuxOutputs, losses: list[jax.Array], weights: tuple[float, ...], loads: list | None = None
) -> AuxOutputs:
    """``aux`` with the depths' weighted sum as the side loss ``mtp`` (trained, left out of
    the loss's value), each depth's loss as the metric ``mtp/loss_<d>`` and their expert
    ``loads`` (``moe_runner``'s) as the state ``MTP_LOAD``."""
    weighted = sum(w * loss for w, loss in zip(weights, losses, strict=True))
    metrics = {f"mtp/loss_{d}": jax.lax.stop_gradient(v) for d, v in enumerate(losses, 1)}
    side = {**aux.side_losses, "mtp": weighted}
    state = {**aux.state, **({MTP_LOAD: jnp.stack(loads)} if loads else {})}
    return AuxOutputs(aux.losses, {**aux.metrics, **metrics}, state, side)
