"""The mixture-of-experts MLP: a router, E gated expert MLPs, optional shared experts.

Each token goes to its k experts (``moe_routing.route``). Dropless by default: every
assignment is computed. Per device (``expert_parallel.routed_experts``: each device's own
tokens, whatever the mesh), the T*k assignments are sorted by expert (a stable
``argsort``), the token rows gathered in that order, the three expert matmuls done as
grouped matmuls (``grouped_matmul``: only the routed rows, on every platform), and the
results put back in token order by the inverse permutation (a gather by ``argsort``'s
inverse, exact both ways), then summed with the routing weights. With ``capacity_factor`` each expert takes at most
``ceil(capacity_factor * T * k / E)`` assignments (first come, first served in token
order); the rest are dropped (their weight 0, counted in ``moe/dropped_fraction``).
Shared experts (DeepSeek-MoE) are one dense gated MLP every token also goes through.
With ``bias_update_rate`` > 0 (or ``routing_bias``) the router holds a per-expert ``bias`` (a ``Buffer``: no
gradient, no optimizer) added to the scores for the choice of experts only; the model
moves it after each step from that step's load (``MixtralLmModel.update_state``).
With ``trainer.mesh.expert`` > 1 the experts are split over devices and the tokens sent to
them (``expert_parallel``); without, the same code runs with one way and no exchange.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from loomax.config import ConfigError
from loomax.models.axes import Embed, Experts, Mlp
from loomax.models.blocks.buffers import Buffer
from loomax.models.blocks.mlp_activations import activation
from loomax.models.moe.expert_adapter import ExpertAdapter
from loomax.models.moe.expert_parallel import routed_experts
from loomax.models.moe.grouped_matmul import IMPLEMENTATIONS
from loomax.models.moe.moe_routing import SCORE_FUNCTIONS, RouterAux, route


@dataclass(frozen=True)
class MoeConfig:
    """The ``model.moe`` section: experts, routing, balance losses, the expert matmul."""

    num_experts: int = 8
    """Routed experts per MoE layer (the `experts` axis)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    expert_intermediate_dim: int | None = None
    """Width of each expert's gated MLP; null = model.intermediate_dim."""
    score_function: str = "softmax"
    """Router scores: softmax over all experts, or sigmoid per expert (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the k chosen scores to sum 1 (Mixtral: true; OLMoE, Qwen3-MoE read it from the checkpoint)."""
    num_shared_experts: int = 0
    """Shared experts every token also goes through (one dense gated MLP of this many experts' width); 0 = none."""
    capacity_factor: float | None = None
    """Each expert takes at most ceil(factor * tokens * k / experts) assignments, the rest dropped; null = dropless."""
    load_balance_loss_weight: float = 0.01
    """Coefficient of the load-balance loss (normalised to 1 at perfect balance, any k); 0 = off."""
    router_z_loss_weight: float = 0.001
    """Coefficient of the router z-loss, mean logsumexp(router logits)^2; 0 = off."""
    num_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts split into this many equal groups, a token's k chosen within its topk_groups best groups (each scored by its two best scores); 1 = off."""
    topk_groups: int = 1
    """Groups a token's experts are chosen from (DeepSeek-V3's topk_group); read with num_groups > 1."""
    routed_scaling_factor: float = 1.0
    """The routed experts' weights times this, after any renormalisation (DeepSeek-V3: 2.5)."""
    routing_bias: bool = False
    """Keep the per-expert routing bias (choice only) even with bias_update_rate 0, e.g. one imported from DeepSeek-V3's e_score_correction_bias; on whenever bias_update_rate > 0."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k choice only, moved this much per step toward balance (bias += rate * sign(mean load - load)); 0 = off."""
    first_dense_layers: int = 0
    """The first N layers have a dense gated MLP of model.intermediate_dim instead of experts (DeepSeek's first_k_dense_replace); 0 = every layer routed."""
    matmul: str = "auto"
    """Grouped matmul: auto (TPU megablox, else blocked), blocked, ragged_dot, megablox."""
    matmul_block: int = 64
    """Rows per block of the blocked grouped matmul (each expert's rows padded to a multiple)."""
    saved_rows: float | None = None
    """Expert parallelism with remat_save [moe_up]: keep this many times a device's mean routed rows (T x k) of the experts' gate/up projections, not the whole dropless buffer; a device holding more recomputes them (null = the whole buffer)."""

    receive_buffer: float | None = None
    """Expert parallelism: each device's receive buffer holds this many times its mean routed rows (T x k), each sender's share at most 1/ways of it, rows past a share dropped (moe/dropped_fraction); null = dropless (ways x T x min(k, E/ways) rows)."""
    expert_bias: bool = False
    """Learned biases on the router and on each expert's gate, up and down projections (gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU in the experts: gate clamped to at most this, up to [-limit, limit], out = (up + 1) * gate * sigmoid(swiglu_alpha * gate); null = act(gate) * up."""
    swiglu_alpha: float = 1.702
    """The clamped SwiGLU's sigmoid gain (used with swiglu_limit)."""

    def __post_init__(self):
        for key in ("num_experts", "num_experts_per_tok", "matmul_block"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.moe.{key} must be >= 1, got {getattr(self, key)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"model.moe.num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                f"model.moe.num_experts ({self.num_experts})"
            )
        self._check_groups()
        if self.score_function not in SCORE_FUNCTIONS:
            raise ConfigError(
                f"model.moe.score_function must be one of {SCORE_FUNCTIONS}, got {self.score_function!r}"
            )
        if self.matmul not in IMPLEMENTATIONS:
            raise ConfigError(
                f"model.moe.matmul must be one of {IMPLEMENTATIONS}, got {self.matmul!r}"
            )
        if self.expert_intermediate_dim is not None and self.expert_intermediate_dim < 1:
            raise ConfigError(
                f"model.moe.expert_intermediate_dim must be >= 1 or null, got {self.expert_intermediate_dim}"
            )
        if self.num_shared_experts < 0:
            raise ConfigError(
                f"model.moe.num_shared_experts must be >= 0, got {self.num_shared_experts}"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(
                f"model.moe.capacity_factor must be positive or null, got {self.capacity_factor}"
            )
        if self.first_dense_layers < 0:
            raise ConfigError(
                f"model.moe.first_dense_layers must be >= 0, got {self.first_dense_layers}"
            )
        if self.receive_buffer is not None and self.receive_buffer <= 0:
            raise ConfigError(
                f"model.moe.receive_buffer must be positive or null, got {self.receive_buffer}"
            )
        if self.swiglu_limit is not None and self.swiglu_limit <= 0:
            raise ConfigError(
                f"model.moe.swiglu_limit must be positive or null, got {self.swiglu_limit}"
            )
        if self.saved_rows is not None and self.saved_rows <= 0:
            raise ConfigError(
                f"model.moe.saved_rows must be positive or null, got {self.saved_rows}"
            )
        for key in ("load_balance_loss_weight", "router_z_loss_weight", "bias_update_rate"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.moe.{key} must be >= 0, got {getattr(self, key)}")

    def _check_groups(self) -> None:
        g, top, e, k = self.num_groups, self.topk_groups, self.num_experts, self.num_experts_per_tok
        if g < 1 or e % g:
            raise ConfigError(
                f"model.moe.num_groups ({g}) must be >= 1 and divide model.moe.num_experts ({e})"
            )
        if g > 1 and not (1 <= top <= g and top * (e // g) >= k):
            raise ConfigError(
                f"model.moe.topk_groups ({top}) must be in 1..num_groups ({g}) and its groups "
                f"hold at least num_experts_per_tok ({k}) experts ({e // g} a group)"
            )
        if self.routed_scaling_factor <= 0:
            raise ConfigError(
                f"model.moe.routed_scaling_factor must be positive, got {self.routed_scaling_factor}"
            )

    @property
    def has_bias(self) -> bool:
        """Whether the router holds the per-expert routing bias (a ``Buffer``)."""
        return self.routing_bias or self.bias_update_rate > 0

    def kept_rows(self, routed: int, buffer: int) -> int:
        """Rows of a ``buffer``-row receive buffer whose gate/up projections a layer keeps
        for its backward, ``routed`` rows a device on average (``saved_rows``; a multiple of
        128, megablox's row tile, from 128 rows on)."""
        if self.saved_rows is None:
            return buffer
        rows = math.ceil(self.saved_rows * routed)
        if rows >= 128:
            rows = 128 * math.ceil(rows / 128)
        return min(buffer, rows)

    def sender_rows(self, tokens: int, ways: int) -> int:
        """Rows of a device's receive buffer for each of the ``ways`` senders of ``tokens``
        tokens each: the dropless bound ``tokens x min(k, E / ways)`` (a token's k experts are
        distinct), or ``receive_buffer`` x the mean routed rows shared out, if smaller."""
        k = self.num_experts_per_tok
        dropless = tokens * min(k, self.num_experts // ways)
        if self.receive_buffer is None:
            return dropless
        return max(1, min(dropless, math.ceil(self.receive_buffer * tokens * k / ways)))

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert may take for ``tokens`` tokens; None = dropless."""
        if self.capacity_factor is None:
            return None
        k, e = self.num_experts_per_tok, self.num_experts
        return max(1, math.ceil(self.capacity_factor * tokens * k / e))


def _weights(key, axes: tuple[Axis, ...], fan_in: int, scale: float = 1.0) -> NamedArray:
    return hax.random.truncated_normal(key, axes, -3, 3) * (scale / math.sqrt(fan_in))


class MoeMlp(eqx.Module):
    """Router ``(experts, embed)``, experts' ``gate``/``up`` ``(experts, embed, mlp)`` and
    ``down`` ``(experts, mlp, embed)``, the shared experts' gated MLP (or None), and the
    aux-loss-free routing bias ``(experts,)`` (a ``Buffer``; None when off); with
    ``expert_bias`` the experts' learned biases (``(experts, mlp)`` twice, ``(experts,
    embed)``) and a router bias; with LoRA on the experts, per-expert low-rank adapters on
    ``gate``, ``up`` and ``down`` (``expert_adapter``; None where off)."""

    router: hnn.Linear
    gate: NamedArray
    up: NamedArray
    down: NamedArray
    shared_gate: hnn.Linear | None
    shared_up: hnn.Linear | None
    shared_down: hnn.Linear | None
    bias: Buffer | None
    moe: MoeConfig = eqx.field(static=True)
    act: str = eqx.field(static=True)
    gate_bias: NamedArray | None = None
    up_bias: NamedArray | None = None
    down_bias: NamedArray | None = None
    gate_lora: ExpertAdapter | None = None  # LoRA on the experts (models/lora/experts.py)
    up_lora: ExpertAdapter | None = None
    down_lora: ExpertAdapter | None = None

    @staticmethod
    def init(
        moe: MoeConfig, Embed_: Axis, width: int, act: str, down_scale: float, *, key
    ) -> MoeMlp:
        """``width``: the model's intermediate_dim (experts' default width and a shared expert's)."""
        k_r, k_g, k_u, k_d, k_sg, k_su, k_sd = jax.random.split(key, 7)
        E = Axis(Experts, moe.num_experts)
        M = Axis(Mlp, moe.expert_intermediate_dim or width)
        router = hnn.Linear.init(Embed_, E, key=k_r, use_bias=moe.expert_bias)
        gate = _weights(k_g, (E, Embed_, M), Embed_.size)
        up = _weights(k_u, (E, Embed_, M), Embed_.size)
        down = _weights(k_d, (E, M, Embed_), M.size, down_scale)
        shared = (None, None, None)
        if moe.num_shared_experts:
            S = Axis(Mlp, moe.num_shared_experts * M.size)
            shared = (
                hnn.Linear.init(Embed_, S, key=k_sg, use_bias=False),
                hnn.Linear.init(Embed_, S, key=k_su, use_bias=False),
                hnn.Linear.init(S, Embed_, key=k_sd, use_bias=False, init_scale=down_scale),
            )
        bias = Buffer(hax.zeros(E)) if moe.has_bias else None
        biases = (hax.zeros((E, M)), hax.zeros((E, M)), hax.zeros((E, Embed_)))
        return MoeMlp(router, gate, up, down, *shared, bias, moe, act,
                      *(biases if moe.expert_bias else ()))  # fmt: skip

    def __call__(
        self, x: NamedArray, aux: RouterAux | None = None, layer=0
    ) -> tuple[NamedArray, RouterAux | None]:
        """``x (..., embed)`` through the experts; ``aux`` (if given) gets row ``layer``."""
        Embed_ = x.resolve_axis(Embed)
        lead = tuple(a for a in x.axes if a.name != Embed)
        t = x.rearrange((*lead, Embed_)).array
        r = self.router.weight.rearrange((Experts, Embed)).array
        logits = jnp.einsum(
            "...d,ed->...e", t, r.astype(t.dtype), preferred_element_type=jnp.float32
        )
        if self.router.bias is not None:
            logits = logits + self.router.bias.rearrange((Experts,)).array
        weights, experts, probs = route(
            logits,
            self.moe.num_experts_per_tok,
            score=self.moe.score_function,
            norm_topk_prob=self.moe.norm_topk_prob,
            bias=None if self.bias is None else self.bias.value.rearrange((Experts,)).array,
            groups=self.moe.num_groups,
            topk_groups=self.moe.topk_groups,
            scale=self.moe.routed_scaling_factor,
        )
        # per device: each device's own tokens, sorted, multiplied and combined where they are
        y, sizes, dropped, recomputed = routed_experts(self, t, weights, experts, lead)
        out = hax.named(y, (*lead, Embed_))
        if self.shared_gate is not None:
            gate, up = self.shared_gate(x), self.shared_up(x)
            out = out + self.shared_down(activation(self.act)(gate) * up).rearrange(out.axes)
        if aux is not None:
            E = self.moe.num_experts
            flat_logits, flat_probs = logits.reshape(-1, E), probs.reshape(-1, E)
            aux = aux.record(layer, flat_logits, flat_probs, sizes, dropped, recomputed)
        return out, aux
