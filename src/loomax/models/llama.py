"""Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, optional tied head.

Options: the gate's activation, biases, weightless norms, norms on the blocks' outputs
(``hybrid_norm``) and on the embeddings, dropout.

Reads top to bottom: config, attention, MLP, block, the whole model. Weight layout and
rotary convention match Hugging Face ``LlamaForCausalLM``, so export is a renaming.
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

from loomax.models import offload, taps
from loomax.models.attention import cached_attention, model_attention
from loomax.models.axes import (
    Embed,
    Heads,
    HeadSize,
    KeyPosition,
    KvHeads,
    Layers,
    Mlp,
    Position,
    Vocab,
)
from loomax.models.config import KvCache, LmConfig, LmModel
from loomax.models.dropout import dropout, split
from loomax.models.layers import layer_inputs, run_layers
from loomax.models.mlp_activations import activation, check_activation
from loomax.models.norms import rms_norm
from loomax.models.remat import name_activation
from loomax.models.rotary import DefaultRotary, RotaryConfig, apply_rotary
from loomax.models.sequence_layout import layout_positions


@LmConfig.register_subclass("llama")
@dataclass(frozen=True)
class LlamaConfig(LmConfig):
    """Llama 2/3 style decoder (Touvron et al. 2023), with grouped-query attention."""

    seq_len: int = 2048
    """Tokens per training sequence (the `position` axis)."""
    hidden_dim: int = 4096
    """Width of the residual stream (the `embed` axis)."""
    intermediate_dim: int = 11008
    """Width of the SwiGLU MLP (the `mlp` axis)."""
    num_layers: int = 32
    """Number of transformer blocks (the `layers` axis)."""
    num_heads: int = 32
    """Query heads."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); null = num_heads; must divide num_heads."""
    head_dim: int | None = None
    """Size of each head; null = hidden_dim / num_heads."""
    rope: RotaryConfig = field(default_factory=DefaultRotary)
    """Rotary embeddings (`type`: default, linear, llama3, yarn) and their `theta`."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the LM head."""
    qk_norm: bool = False
    """RMSNorm over head_size on queries and keys before rotary (as in OLMo 2 / Qwen 3)."""
    qk_norm_over_heads: bool = False
    """With qk_norm: one RMSNorm over the whole query (key) projection, all heads together (OLMoE), not per head."""
    initializer_range: float = 0.02
    """Standard deviation of the embedding initialisation."""
    activation_function: str = "silu"
    """The gate's nonlinearity, act(gate(x)) * up(x), by its transformers name: silu (SwiGLU), gelu (GeGLU), relu, ..."""
    use_bias: bool = False
    """Biases in every attention and MLP projection (transformers' attention_bias and mlp_bias); norms have none."""
    use_layer_norm_weight: bool = True
    """A learned scale in every RMSNorm; false = plain RMS normalisation."""
    hybrid_norm: bool = False
    """Also RMSNorm the attention and MLP outputs before they join the residual stream (sandwich norm)."""
    input_embedding_norm: bool = False
    """An RMSNorm on the token embeddings, before the first block."""

    def __post_init__(self):
        super().__post_init__()
        check_activation(self.activation_function)
        for name in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model.num_kv_heads ({self.kv_heads}) must divide model.num_heads ({self.num_heads})"
            )
        if self.head_dim is None and self.hidden_dim % self.num_heads:
            raise ValueError(
                f"model.hidden_dim ({self.hidden_dim}) must be divisible by model.num_heads "
                f"({self.num_heads}), or set model.head_dim"
            )
        if self.qk_norm_over_heads and not self.qk_norm:
            raise ValueError("model.qk_norm_over_heads needs model.qk_norm: true")
        if self.head_size % 2:
            raise ValueError(
                f"model.head_dim must be even for rotary embeddings, got {self.head_size}"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_dim // self.num_heads

    # Axes -------------------------------------------------------------------------------
    @property
    def Embed(self) -> Axis:
        return Axis(Embed, self.hidden_dim)

    @property
    def Heads(self) -> Axis:
        return Axis(Heads, self.num_heads)

    @property
    def KvHeads(self) -> Axis:
        return Axis(KvHeads, self.kv_heads)

    @property
    def HeadSize(self) -> Axis:
        return Axis(HeadSize, self.head_size)

    @property
    def Mlp(self) -> Axis:
        return Axis(Mlp, self.intermediate_dim)

    @property
    def Layers(self) -> Axis:
        return Axis(Layers, self.num_layers)

    def make_norm(self, axis: Axis | tuple[Axis, ...]) -> hnn.RmsNorm:
        """An RMSNorm over ``axis`` as configured (epsilon, learned scale or none)."""
        return rms_norm(axis, self.rms_norm_eps, use_weight=self.use_layer_norm_weight)

    def build(self, vocab_size: int, *, key: PRNGKeyArray) -> LlamaLmModel:
        return LlamaLmModel.init(self, Axis(Vocab, vocab_size), key=key)

    def flops_per_token(self, vocab_size: int, *, causal: bool = True) -> float:
        d, m, s = self.hidden_dim, self.intermediate_dim, self.seq_len
        q = self.num_heads * self.head_size
        kv = self.kv_heads * self.head_size
        attn = (2 if causal else 4) * s * q  # QK^T and PV: the causal half, or the full square
        per_layer = 2 * d * (2 * q + 2 * kv) + 2 * 3 * d * m + attn  # qkvo, mlp, attn
        return float(self.num_layers * per_layer + 2 * d * vocab_size)


def _linear(
    In, Out, *, key: PRNGKeyArray, init_scale: float = 1.0, use_bias: bool = False
) -> hnn.Linear:
    return hnn.Linear.init(In=In, Out=Out, key=key, use_bias=use_bias, init_scale=init_scale)


class LlamaAttention(eqx.Module):
    """Grouped-query causal attention with rotary positions (and optional QK-norm)."""

    q_proj: hnn.Linear  # embed -> (heads, head_size)
    k_proj: hnn.Linear  # embed -> (kv_heads, head_size)
    v_proj: hnn.Linear  # embed -> (kv_heads, head_size)
    o_proj: hnn.Linear  # (heads, head_size) -> embed
    q_norm: hnn.RmsNorm | None
    k_norm: hnn.RmsNorm | None
    config: LlamaConfig = eqx.field(static=True)

    @staticmethod
    def init(config: LlamaConfig, *, key: PRNGKeyArray) -> LlamaAttention:
        k_q, k_k, k_v, k_o = jax.random.split(key, 4)
        c, bias = config, config.use_bias
        q_norm = k_norm = None
        if c.qk_norm and c.qk_norm_over_heads:
            q_norm = c.make_norm((c.Heads, c.HeadSize))
            k_norm = c.make_norm((c.KvHeads, c.HeadSize))
        elif c.qk_norm:
            q_norm, k_norm = c.make_norm(c.HeadSize), c.make_norm(c.HeadSize)
        out_scale = 1 / math.sqrt(2 * c.num_layers)
        return LlamaAttention(
            _linear(c.Embed, (c.Heads, c.HeadSize), key=k_q, use_bias=bias),
            _linear(c.Embed, (c.KvHeads, c.HeadSize), key=k_k, use_bias=bias),
            _linear(c.Embed, (c.KvHeads, c.HeadSize), key=k_v, use_bias=bias),
            _linear((c.Heads, c.HeadSize), c.Embed, key=k_o, init_scale=out_scale, use_bias=bias),
            q_norm,
            k_norm,
            config,
        )

    def _qkv(self, x: NamedArray, positions: NamedArray):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, positions, self.config.rope)
        k = apply_rotary(k, positions, self.config.rope)
        return name_activation((q, k, v), "qkv")

    def __call__(
        self,
        x: NamedArray,
        segment_ids: NamedArray | None = None,
        *,
        key: PRNGKeyArray | None = None,
    ) -> NamedArray:
        """``key`` drops out attention probabilities (``attn_pdrop``)."""
        q, k, v = self._qkv(x, layout_positions(x.resolve_axis(Position)))
        out = model_attention(self.config, q, k, v, segment_ids, key=key)
        return self.o_proj(name_activation(out, "attn_out"))

    def decode(self, x: NamedArray, cache_k, cache_v, start):
        """Attention over the cache for new positions from ``start``; returns the new cache too."""
        q, k, v = self._qkv(x, hax.arange(x.resolve_axis(Position)) + start)
        out, cache_k, cache_v = cached_attention(q, k, v, cache_k, cache_v, start)
        return self.o_proj(out), cache_k, cache_v


class LlamaMlp(eqx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with the default ``silu``."""

    gate_proj: hnn.Linear
    up_proj: hnn.Linear
    down_proj: hnn.Linear
    act: str = eqx.field(static=True)

    @staticmethod
    def init(config: LlamaConfig, *, key: PRNGKeyArray) -> LlamaMlp:
        k_gate, k_up, k_down = jax.random.split(key, 3)
        c, bias = config, config.use_bias
        down_scale = 1 / math.sqrt(2 * c.num_layers)
        return LlamaMlp(
            _linear(c.Embed, c.Mlp, key=k_gate, use_bias=bias),
            _linear(c.Embed, c.Mlp, key=k_up, use_bias=bias),
            _linear(c.Mlp, c.Embed, key=k_down, init_scale=down_scale, use_bias=bias),
            c.activation_function,
        )

    def __call__(self, x: NamedArray) -> NamedArray:
        gate, up = name_activation((self.gate_proj(x), self.up_proj(x)), "mlp_up")
        return self.down_proj(activation(self.act)(gate) * up)


class LlamaBlock(eqx.Module):
    """Pre-norm block: x + attn(rms(x)), then x + mlp(rms(x)); with ``hybrid_norm`` the
    outputs are normed too: x + rms(attn(rms(x))), then x + rms(mlp(rms(x)))."""

    input_norm: hnn.RmsNorm
    attn: LlamaAttention
    post_attn_norm: hnn.RmsNorm
    mlp: LlamaMlp
    attn_out_norm: hnn.RmsNorm | None
    mlp_out_norm: hnn.RmsNorm | None
    config: LlamaConfig = eqx.field(static=True)

    @staticmethod
    def init(config: LlamaConfig, *, key: PRNGKeyArray) -> LlamaBlock:
        k_attn, k_mlp = jax.random.split(key)
        c = config
        out_norms = (c.make_norm(c.Embed), c.make_norm(c.Embed)) if c.hybrid_norm else (None, None)
        return LlamaBlock(
            c.make_norm(c.Embed),
            LlamaAttention.init(config, key=k_attn),
            c.make_norm(c.Embed),
            LlamaMlp.init(config, key=k_mlp),
            *out_norms,
            config,
        )

    def __call__(
        self,
        x: NamedArray,
        segment_ids: NamedArray | None = None,
        *,
        key: PRNGKeyArray | None = None,
    ) -> NamedArray:
        """``key`` (training) drives this block's dropout."""
        k_probs, k_attn, k_mlp = split(key, 3)
        rate = self.config.resid_pdrop
        attn = taps.tap("attn_out", self.attn(self.input_norm(x), segment_ids, key=k_probs))
        x = x + dropout(_maybe(self.attn_out_norm, attn), rate, k_attn)
        mlp_in = taps.tap("mlp_in", name_activation(self.post_attn_norm(x), "mlp_in"))
        mlp = taps.tap("mlp_out", self.mlp(mlp_in))
        x = x + dropout(_maybe(self.mlp_out_norm, mlp), rate, k_mlp)
        return hax.auto_sharded(x)

    def decode(self, x: NamedArray, cache: KvCache, start) -> tuple[NamedArray, KvCache]:
        attn, k, v = self.attn.decode(self.input_norm(x), cache.k, cache.v, start)
        x = x + _maybe(self.attn_out_norm, attn)
        return x + _maybe(self.mlp_out_norm, self.mlp(self.post_attn_norm(x))), KvCache(k, v)


def _maybe(norm: hnn.RmsNorm | None, x: NamedArray) -> NamedArray:
    return x if norm is None else norm(x)


class LlamaLmModel(LmModel):
    """Token embeddings, a scanned stack of blocks, a final RMSNorm and the LM head."""

    config: LlamaConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    blocks: hnn.Stacked[LlamaBlock]
    norm: hnn.RmsNorm
    lm_head: hnn.Linear | None
    embed_norm: hnn.RmsNorm | None = None  # input_embedding_norm

    @staticmethod
    def init(config: LlamaConfig, Vocab: Axis, *, key: PRNGKeyArray) -> LlamaLmModel:
        k_tok, k_blocks, k_head = jax.random.split(key, 3)
        weight = hax.random.normal(k_tok, (Vocab, config.Embed)) * config.initializer_range
        embed = hnn.Embedding(weight, Vocab, config.Embed)
        blocks = hnn.Stacked.init(
            config.Layers, LlamaBlock, gradient_checkpointing=config.remat_policy
        )(config, key=jax.random.split(k_blocks, config.num_layers))
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = _linear(config.Embed, Vocab, key=k_head)
        embed_norm = config.make_norm(config.Embed) if config.input_embedding_norm else None
        return LlamaLmModel(
            config, embed, blocks, config.make_norm(config.Embed), lm_head, embed_norm
        )

    @property
    def Vocab(self) -> Axis:
        return self.embed_tokens.Vocab

    def hidden_states(
        self,
        tokens: NamedArray,
        *,
        segment_ids: NamedArray | None = None,
        key: PRNGKeyArray | None = None,
    ) -> NamedArray:
        c = self.config
        x = _maybe(self.embed_norm, hax.auto_sharded(self.embed_tokens.embed(tokens)))
        k_embed, k_layers = split(key if c.dropout_active else None, 2)
        x = dropout(x, c.embed_pdrop, k_embed)
        per_layer = layer_inputs(c.num_layers, key=k_layers)
        x = run_layers(
            self.blocks,
            x,
            segment_ids,
            scan=c.scan_layers,
            unroll=c.scan_unroll,
            per_layer=per_layer,
        )
        return taps.tap("final", self.norm(x))

    def init_cache(self, batch_axes, max_len: int, dtype) -> KvCache:
        c = self.config
        axes = (c.Layers, *batch_axes, Axis(KeyPosition, max_len), c.KvHeads, c.HeadSize)
        return KvCache(hax.zeros(axes, dtype), hax.zeros(axes, dtype))

    def decode(self, tokens: NamedArray, cache: KvCache, start) -> tuple[NamedArray, KvCache]:
        def layer(x, block, layer_cache):
            return block.decode(x, layer_cache, start)

        x = _maybe(self.embed_norm, self.embed_tokens.embed(tokens))
        x, cache = offload.scan(layer, self.config.Layers)(x, self.blocks.stacked, cache)
        return self.norm(x), cache

    def lm_head_weight(self) -> NamedArray:
        if self.lm_head is None:
            return self.embed_tokens.weight
        return self.lm_head.weight
