"""Mixtral: Llama's attention and blocks with a mixture-of-experts MLP (Jiang et al. 2024).

``model.type: mixtral`` is a ``LlamaConfig`` plus the ``moe`` section: the attention,
norms, rotary positions and the model around the blocks are Llama's own; each block's MLP
is ``models.moe.MoeMlp`` (softmax router, top-k renormalised, dropless by default). The
residual stream carries a ``RouterAux`` through the layer stack beside the activations, so
the balance losses and router metrics come out of the scanned stack as the model's
``AuxOutputs``. Weight layout and routing match Hugging Face ``MixtralForCausalLM``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
from haliax import Axis, NamedArray
from jaxtyping import PRNGKeyArray

from loomax.config import ConfigError
from loomax.models import taps
from loomax.models.axes import Vocab
from loomax.models.config import AuxOutputs, KvCache, LmConfig
from loomax.models.dropout import dropout, split
from loomax.models.layers import layer_inputs, run_layers
from loomax.models.llama import LlamaAttention, LlamaConfig, LlamaLmModel, _maybe
from loomax.models.moe import MoeConfig, MoeMlp
from loomax.models.moe_routing import RouterAux
from loomax.models.remat import name_activation


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

    @property
    def expert_dim(self) -> int:
        """Width of each expert's MLP."""
        return self.moe.expert_intermediate_dim or self.intermediate_dim

    def build(self, vocab_size: int, *, key: PRNGKeyArray) -> MixtralLmModel:
        return MixtralLmModel.init(self, Axis(Vocab, vocab_size), key=key)

    def flops_per_token(self, vocab_size: int, *, causal: bool = True) -> float:
        """Forward FLOPs of the active parameters: k routed experts, shared experts, router;
        causal attention counted as half the score matrix unless ``causal`` is false."""
        d, s, moe = self.hidden_dim, self.seq_len, self.moe
        q = self.num_heads * self.head_size
        kv = self.kv_heads * self.head_size
        experts = moe.num_experts_per_tok + moe.num_shared_experts
        mlp = 2 * 3 * d * self.expert_dim * experts + 2 * d * moe.num_experts
        attn = (2 if causal else 4) * s * q  # QK^T and PV: the causal half, or the full square
        per_layer = 2 * d * (2 * q + 2 * kv) + mlp + attn  # qkvo, experts, attn
        return float(self.num_layers * per_layer + 2 * d * vocab_size)


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
        attn = taps.tap("attn_out", self.attn(self.input_norm(x), segment_ids, key=k_probs))
        x = x + dropout(attn, rate, k_attn)
        mlp_in = taps.tap("mlp_in", name_activation(self.post_attn_norm(x), "mlp_in"))
        mlp, aux = self.mlp(mlp_in, aux, layer)
        x = x + dropout(taps.tap("mlp_out", mlp), rate, k_mlp)
        return hax.auto_sharded(x), aux

    def decode(self, x: NamedArray, cache: KvCache, start) -> tuple[NamedArray, KvCache]:
        attn, k, v = self.attn.decode(self.input_norm(x), cache.k, cache.v, start)
        x = x + attn
        return x + self.mlp(self.post_attn_norm(x))[0], KvCache(k, v)


class MixtralLmModel(LlamaLmModel):
    """Llama's model around a stack of ``MixtralBlock``s (decoding and the head are Llama's)."""

    config: MixtralConfig = eqx.field(static=True)
    blocks: hnn.Stacked[MixtralBlock]

    @staticmethod
    def init(config: MixtralConfig, Vocab: Axis, *, key: PRNGKeyArray) -> MixtralLmModel:
        k_tok, k_blocks, k_head = jax.random.split(key, 3)
        weight = hax.random.normal(k_tok, (Vocab, config.Embed)) * config.initializer_range
        embed = hnn.Embedding(weight, Vocab, config.Embed)
        blocks = hnn.Stacked.init(
            config.Layers, MixtralBlock, gradient_checkpointing=config.remat_policy
        )(config, key=jax.random.split(k_blocks, config.num_layers))
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = hnn.Linear.init(config.Embed, Vocab, key=k_head, use_bias=False)
        embed_norm = config.make_norm(config.Embed) if config.input_embedding_norm else None
        return MixtralLmModel(
            config, embed, blocks, config.make_norm(config.Embed), lm_head, embed_norm
        )

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
        c = self.config
        x = _maybe(self.embed_norm, hax.auto_sharded(self.embed_tokens.embed(tokens)))
        k_embed, k_layers = split(key if c.dropout_active else None, 2)
        x = dropout(x, c.embed_pdrop, k_embed)
        per_layer = layer_inputs(c.num_layers, key=k_layers, layer_index=True)
        carry = (x, RouterAux.zeros(c.num_layers, c.moe.num_experts))
        x, aux = run_layers(
            self.blocks,
            carry,
            segment_ids,
            scan=c.scan_layers,
            unroll=c.scan_unroll,
            per_layer=per_layer,
        )
        losses = aux.losses(c.moe.load_balance_loss_weight, c.moe.router_z_loss_weight)
        return taps.tap("final", self.norm(x)), AuxOutputs(losses, aux.metrics())
