"""Mixtral: Llama's attention and blocks with a mixture-of-experts MLP (Jiang et al. 2024).

``model.type: mixtral`` is a ``LlamaConfig`` plus the ``moe`` section: the attention,
norms, rotary positions and the model around the blocks are Llama's own; each block's MLP
is ``models.moe.MoeMlp`` (softmax router, top-k renormalised, dropless by default). The
residual stream carries a ``RouterAux`` through the layer stack beside the activations, so
the balance losses and router metrics come out of the scanned stack as the model's
``AuxOutputs``. Weight layout and routing match Hugging Face ``MixtralForCausalLM``.

Its HF side (``loomax.hf.family.HfFamily``, on the config): Hub checkpoints hold one tensor
per expert, ``model.layers.N.block_sparse_moe.experts.E.{w1,w2,w3}.weight`` (w1 the gate, w3
the up, w2 the down projection) and the router ``...block_sparse_moe.gate.weight``.
``router_aux_loss_coef`` is HF's load-balance coefficient, whose loss is k at perfect
balance, Loomax's 1: the weight is multiplied by k on import and divided on export.
``MixtralForCausalLM`` routes by softmax, renormalises the top k and drops nothing, with no
shared experts or biases: export refuses other settings, naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jaxtyping import PRNGKeyArray

from loomax.config import ConfigError
from loomax.models.attention.max_logits import stack_key
from loomax.models.axes import Experts, Vocab
from loomax.models.blocks import taps
from loomax.models.blocks.decoder import LlamaAttention, LlamaBlock, LlamaLmModel, _maybe
from loomax.models.blocks.dropout import dropout, split
from loomax.models.blocks.remat import name_activation
from loomax.models.config import AuxOutputs, KvCache, LmConfig
from loomax.models.families.llama import LlamaConfig
from loomax.models.io.hf_layout import Param
from loomax.models.layers import layer_inputs, run_layers
from loomax.models.moe.moe import MoeConfig, MoeMlp
from loomax.models.moe.moe_routing import RouterAux


@LmConfig.register_subclass("mixtral")
@dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """Mixtral-style sparse decoder: Llama blocks whose MLP is a mixture of experts."""

    moe: MoeConfig = field(default_factory=MoeConfig)
    """Experts, routing, balance losses and the grouped matmul (the `moe` section)."""

    def __post_init__(self):
        super().__post_init__()
        if self.hybrid_norm:
            raise ConfigError("model.hybrid_norm is not supported by model.type mixtral")
        if self.moe.first_dense_layers >= self.num_layers:
            raise ConfigError(
                f"model.moe.first_dense_layers ({self.moe.first_dense_layers}) must be less than "
                f"model.num_layers ({self.num_layers}): at least one layer has experts"
            )

    @property
    def MoeLayers(self) -> Axis:
        """The ``layers`` axis of the routed blocks (after ``moe.first_dense_layers``)."""
        return Axis(self.Layers.name, self.num_layers - self.moe.first_dense_layers)

    @property
    def expert_dim(self) -> int:
        """Width of each expert's MLP."""
        return self.moe.expert_intermediate_dim or self.intermediate_dim

    def build(self, vocab_size: int, *, key: PRNGKeyArray) -> MixtralLmModel:
        return MixtralLmModel.init(self, Axis(Vocab, vocab_size), key=key)

    def flops_per_token(self, vocab_size: int, *, causal: bool = True) -> float:
        """Forward FLOPs of the active parameters: k routed experts, shared experts, router;
        causal attention counted as half the score matrix unless ``causal`` is false."""
        d, moe = self.hidden_dim, self.moe
        q = self.num_heads * self.head_size
        kv = self.kv_heads * self.head_size
        experts = moe.num_experts_per_tok + moe.num_shared_experts
        mlp = 2 * 3 * d * self.expert_dim * experts + 2 * d * moe.num_experts
        attn = 2 * d * (2 * q + 2 * kv)  # qkvo projections
        dense = self.moe.first_dense_layers
        routed = (self.num_layers - dense) * (attn + mlp)
        dense_flops = dense * (attn + 2 * 3 * d * self.intermediate_dim)
        return float(
            routed + dense_flops + self.num_layers * self.attn_flops(causal) + 2 * d * vocab_size
        )

    # Hugging Face (loomax.hf.family.HfFamily) ---------------------------------------------
    hf_model_type: ClassVar[str | None] = "mixtral"
    hf_architecture: ClassVar[str] = "MixtralForCausalLM"
    hf_run_keys: ClassVar[tuple[str, ...]] = (
        *LlamaConfig.hf_run_keys,
        "router_aux_loss_coef",
    )
    """config.json fields a run may change: dropout, context length, the balance loss weight."""
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **LlamaConfig.hf_field_names,
        "intermediate_size": "intermediate_dim", "num_local_experts": "moe.num_experts",
        "num_experts_per_tok": "moe.num_experts_per_tok",
        "router_aux_loss_coef": "moe.load_balance_loss_weight", "router_jitter_noise": None,
        "sliding_window": "sliding_window",
    }  # fmt: skip
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **{k: v for k, v in LlamaConfig.hf_requires.items() if k != "sliding_window"},
        "use_bias": (False, "has no biases"),
    }
    hf_moe_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        "score_function": ("softmax", "routes by a softmax"),
        "norm_topk_prob": (True, "renormalises the top-k weights"),
        "num_shared_experts": (0, "has no shared experts"),
        "capacity_factor": (None, "drops no tokens"),
        "expert_intermediate_dim": (None, "sizes experts by intermediate_size"),
        "first_dense_layers": (0, "routes every layer"),
        "bias_update_rate": (0.0, "has no routing bias"),
        "routing_bias": (False, "has no routing bias"),
        "num_groups": (1, "routes over all experts (no groups)"),
        "routed_scaling_factor": (1.0, "does not scale the routed weights"),
    }
    """What export needs of a ``model.moe`` key, and what the HF class lacks otherwise."""
    hf_expert_names: ClassVar[tuple[str, str, str, str]] = (
        "block_sparse_moe.",
        "w1",
        "w3",
        "w2",
    )
    """The MoE module's prefix and the gate, up and down projections' names."""

    def hf_params(self) -> list[Param]:
        """Llama's attention and norm tensors, and the router and each expert (``{e}``)."""
        s = lambda m: m.blocks.stacked  # noqa: E731
        moe = "model.layers.{i}." + self.hf_expert_names[0]
        gate, up, down = (f"{moe}experts.{{e}}.{n}.weight" for n in self.hf_expert_names[1:])
        dense = [p for p in super().hf_params() if ".mlp." not in p.hf_name]
        return dense + [
            Param(moe + "gate.weight", lambda m: s(m).mlp.router.weight, ("experts", "embed")),
            Param(gate, lambda m: s(m).mlp.gate, ("mlp", "embed")),
            Param(up, lambda m: s(m).mlp.up, ("mlp", "embed")),
            Param(down, lambda m: s(m).mlp.down, ("embed", "mlp")),
        ]

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        for key, (want, what) in self.hf_moe_requires.items():
            if getattr(self.moe, key) != want:
                raise ConfigError(
                    f"{self.hf_architecture} {what}: export needs model.moe.{key}: {want}"
                )
        out = super().hf_config(vocab_size)
        del out["attention_bias"], out["mlp_bias"]
        k = self.moe.num_experts_per_tok
        return {
            **out,
            "num_local_experts": self.moe.num_experts,
            "num_experts_per_tok": k,
            "router_aux_loss_coef": self.moe.load_balance_loss_weight / k,
            "router_jitter_noise": 0.0,
            "sliding_window": self.sliding_window,
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> MixtralConfig:
        window = hf.get("sliding_window")
        return cls(sliding_window=window, moe=cls._hf_moe(hf, 8, 2, 0.001), **cls._hf_fields(hf))

    @classmethod
    def _hf_moe(cls, hf: dict[str, Any], experts: int, k: int, coef: float) -> MoeConfig:
        """The ``moe`` section of a config.json (defaults: transformers' for the family)."""
        k = hf.get("num_experts_per_tok", k)
        return replace(
            cls().moe,
            num_experts=hf.get("num_experts", hf.get("num_local_experts", experts)),
            num_experts_per_tok=k,
            load_balance_loss_weight=hf.get("router_aux_loss_coef", coef) * k,
            **({"norm_topk_prob": bool(hf["norm_topk_prob"])} if "norm_topk_prob" in hf else {}),
        )


class MixtralBlock(eqx.Module):
    """Pre-norm block: x + attn(rms(x)), then x + moe(rms(x)); the carry is ``(x, aux)``."""

    input_norm: hnn.RmsNorm
    attn: LlamaAttention
    post_attn_norm: hnn.RmsNorm
    mlp: MoeMlp
    config: MixtralConfig = eqx.field(static=True)

    @staticmethod
    def init(config: MixtralConfig, *, key: PRNGKeyArray) -> MixtralBlock:
        k_attn, k_mlp = jax.random.split(key)
        c = config
        mlp = MoeMlp.init(
            c.moe,
            c.Embed,
            c.intermediate_dim,
            c.activation_function,
            1 / math.sqrt(2 * c.num_layers),
            key=k_mlp,
        )
        return MixtralBlock(
            c.make_norm(c.Embed), LlamaAttention.init(c, key=k_attn), c.make_norm(c.Embed), mlp, c
        )

    def __call__(
        self,
        carry: tuple[NamedArray, RouterAux],
        segment_ids: NamedArray | None = None,
        *,
        key: PRNGKeyArray | None = None,
        layer=0,
    ) -> tuple[NamedArray, RouterAux]:
        """``key`` (training) drives this block's dropout; ``layer`` is its row in ``aux``."""
        x, aux = carry
        k_probs, k_attn, k_mlp = split(key, 3)
        rate = self.config.resid_pdrop
        here = layer + self.config.moe.first_dense_layers  # the model's layer (its window)
        attn = self.attn(self.input_norm(x), segment_ids, key=k_probs, layer=here)
        attn = taps.tap("attn_out", attn)
        x = x + dropout(attn, rate, k_attn)
        mlp_in = taps.tap("mlp_in", name_activation(self.post_attn_norm(x), "mlp_in"))
        mlp, aux = self.mlp(mlp_in, aux, layer)
        x = x + dropout(taps.tap("mlp_out", mlp), rate, k_mlp)
        return hax.auto_sharded(x), aux

    def decode(
        self, x: NamedArray, cache: KvCache, start, layer=None, **window
    ) -> tuple[NamedArray, KvCache]:
        """One decode step (``window``: ``LlamaAttention.decode``'s)."""
        attn, k, v = self.attn.decode(self.input_norm(x), cache.k, cache.v, start, layer, **window)
        x = x + attn
        return x + self.mlp(self.post_attn_norm(x))[0], KvCache(k, v)


class MixtralLmModel(LlamaLmModel):
    """Llama's model around a stack of ``MixtralBlock``s (decoding and the head are Llama's)."""

    config: MixtralConfig = eqx.field(static=True)
    blocks: hnn.Stacked[MixtralBlock]
    dense_blocks: hnn.Stacked[LlamaBlock] | None = None  # moe.first_dense_layers

    @staticmethod
    def init(config: MixtralConfig, Vocab: Axis, *, key: PRNGKeyArray) -> MixtralLmModel:
        k_tok, k_blocks, k_head = jax.random.split(key, 3)
        weight = hax.random.normal(k_tok, (Vocab, config.Embed)) * config.initializer_range
        embed = hnn.Embedding(weight, Vocab, config.Embed)
        keys, n = jax.random.split(k_blocks, config.num_layers), config.moe.first_dense_layers
        remat = config.remat_policy
        blocks = hnn.Stacked.init(config.MoeLayers, MixtralBlock, gradient_checkpointing=remat)(
            config, key=keys[n:]
        )
        dense = None
        if n:  # the first n layers: Llama blocks with a dense MLP
            dense_layers = Axis(config.Layers.name, n)
            dense = hnn.Stacked.init(dense_layers, LlamaBlock, gradient_checkpointing=remat)(
                config, key=keys[:n]
            )
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = hnn.Linear.init(config.Embed, Vocab, key=k_head, use_bias=False)
        embed_norm = config.make_norm(config.Embed) if config.input_embedding_norm else None
        norm = config.make_norm(config.Embed)
        return MixtralLmModel(config, embed, blocks, norm, lm_head, embed_norm, dense)

    def hidden_states(
        self,
        tokens: NamedArray,
        *,
        segment_ids: NamedArray | None = None,
        key: PRNGKeyArray | None = None,
    ) -> NamedArray:
        return self.hidden_states_and_aux(tokens, segment_ids=segment_ids, key=key)[0]

    def hidden_states_and_aux(
        self,
        tokens: NamedArray,
        *,
        segment_ids: NamedArray | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[NamedArray, AuxOutputs]:
        x, aux = self.residual_and_aux(tokens, segment_ids=segment_ids, key=key)
        return taps.tap("final", self.norm(x)), aux

    def residual_and_aux(
        self,
        tokens: NamedArray,
        *,
        segment_ids: NamedArray | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[NamedArray, AuxOutputs]:
        """The residual stream after the last block (before the final norm) and the aux outputs."""
        c = self.config
        x = _maybe(self.embed_norm, hax.auto_sharded(self.embed_tokens.embed(tokens)))
        k_embed, k_layers = split(key if c.dropout_active else None, 2)
        x = dropout(x, c.embed_pdrop, k_embed)
        per_layer = layer_inputs(c.num_layers, key=k_layers, layer_index=True)
        n = c.moe.first_dense_layers
        run = dict(scan=c.scan_layers, unroll=c.scan_unroll)
        if self.dense_blocks is not None:
            first = {k: v[:n] for k, v in per_layer.items()}
            x = run_layers(self.dense_blocks, x, segment_ids, per_layer=first, **run)
        # the routed layers' index is their row of the router statistics
        routed = {k: v[n:] - n if k == "layer" else v[n:] for k, v in per_layer.items()}
        carry = (x, RouterAux.zeros(c.num_layers - n, c.moe.num_experts))
        x, aux = run_layers(self.blocks, carry, segment_ids, per_layer=routed, first_layer=n, **run)
        losses = self.router_losses(aux)
        metrics, state = aux.metrics(), {}
        bias = self.blocks.stacked.mlp.bias
        if bias is not None:  # aux-loss-free balancing: the step moves the bias from the load
            state["moe_load"] = aux.load
            metrics.update(bias_metrics(bias.value.rearrange((c.Layers.name, Experts)).array))
        return x, AuxOutputs(losses, metrics, state)

    def router_losses(self, aux: RouterAux) -> dict[str, jax.Array]:
        """The weighted balance and z losses of the router statistics ``aux`` (per-token
        means; linear in ``aux``: a staged stack's chunks each differentiate their rows')."""
        moe = self.config.moe
        return aux.losses(moe.load_balance_loss_weight, moe.router_z_loss_weight)

    def decode_stacks(self) -> list[hnn.Stacked]:
        """The dense first layers' blocks (``moe.first_dense_layers``), then the MoE blocks."""
        return [self.blocks] if self.dense_blocks is None else [self.dense_blocks, self.blocks]

    def qk_clip_attention(self) -> dict[str, Any]:
        """The dense first layers' attention and the MoE blocks' (``LlamaLmModel``'s)."""
        n = self.config.moe.first_dense_layers
        where = {stack_key(n): lambda m: m.blocks.stacked.attn}
        if self.dense_blocks is not None:
            where[stack_key(0)] = lambda m: m.dense_blocks.stacked.attn
        return where

    def update_state(self, stats: dict[str, jax.Array]) -> MixtralLmModel:
        """The routing bias after a step whose mean expert load was ``stats["moe_load"]``
        ``[layers, experts]``: each expert's bias rises by ``bias_update_rate`` when it is
        under the mean load, falls when over (DeepSeek-V3's aux-loss-free balancing)."""
        bias, rate = self.blocks.stacked.mlp.bias, self.config.moe.bias_update_rate
        if bias is None or not rate or "moe_load" not in stats:  # a kept bias moves only at a rate
            return self
        load = stats["moe_load"]
        step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        value = bias.value.rearrange((self.config.Layers.name, Experts))
        new = hax.named(value.array + (rate * step).astype(value.dtype), value.axes)
        return eqx.tree_at(lambda m: m.blocks.stacked.mlp.bias.value, self, new)


def bias_metrics(bias: jax.Array) -> dict[str, jax.Array]:
    """``moe/router_bias_spread`` (max - min over experts, mean over layers) and per layer."""
    spread = jax.lax.stop_gradient(jnp.max(bias, axis=-1) - jnp.min(bias, axis=-1))
    width = len(str(bias.shape[0] - 1))
    out = {"moe/router_bias_spread": jnp.mean(spread)}
    out.update(
        {f"moe/layer_{i:0{width}d}/router_bias_spread": spread[i] for i in range(len(spread))}
    )
    return out
