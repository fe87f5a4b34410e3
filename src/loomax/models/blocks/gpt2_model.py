"""The GPT-2 model: fused-QKV attention, GELU MLP, pre-LayerNorm block, learned positions.

Its config is ``loomax.models.families.gpt2.Gpt2Config``. Reads top to bottom: attention, MLP,
block, the whole model.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jaxtyping import PRNGKeyArray

from loomax.models.attention.attention import cached_attention, model_attention
from loomax.models.attention.sequence_layout import context_ways, layout_positions, token_positions
from loomax.models.axes import KeyPosition, Position
from loomax.models.blocks import taps
from loomax.models.blocks.dropout import adapter_keys, dropout, split
from loomax.models.blocks.mlp_activations import activation
from loomax.models.blocks.norms import layer_norm
from loomax.models.blocks.remat import name_activation
from loomax.models.config import KvCache, LmModel
from loomax.models.decoding.split_prefill import split_prefill_attention
from loomax.models.decoding.stack import decode_layers
from loomax.models.layers import layer_inputs, run_layers


class Gpt2ModelConfig(Protocol):
    """What the model reads of its config: ``loomax.models.families.gpt2.Gpt2Config`` provides it;
    named here so that this module needs no import of its config."""

    Embed: Axis
    Heads: Axis
    HeadSize: Axis
    Mlp: Axis
    Layers: Axis
    Pos: Axis
    num_layers: int
    activation_function: str
    initializer_range: float
    layer_norm_epsilon: float
    scale_attn_by_inverse_layer_idx: bool
    tie_word_embeddings: bool
    use_bias: bool
    dropout_active: bool
    embed_pdrop: float
    resid_pdrop: float
    remat_policy: Any
    scan_layers: bool
    scan_unroll: int | bool


def _normal(key: PRNGKeyArray, axes, std: float) -> NamedArray:
    return hax.random.normal(key, axes) * std


def _residual_projection(config: Gpt2ModelConfig, In, *, key: PRNGKeyArray) -> hnn.Linear:
    """A projection back into the residual stream, its init scaled by 1/sqrt(2 * layers) (GPT-2)."""
    return hnn.Linear.init(
        In=In,
        Out=config.Embed,
        key=key,
        use_bias=config.use_bias,
        init_scale=1 / math.sqrt(2 * config.num_layers),
    )


class Gpt2Attention(eqx.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    qkv: hnn.Linear  # embed -> (qkv, heads, head_size)
    out: hnn.Linear  # (heads, head_size) -> embed
    config: Gpt2ModelConfig = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2ModelConfig, *, key: PRNGKeyArray) -> Gpt2Attention:
        k_qkv, k_out = jax.random.split(key)
        Qkv = Axis("qkv", 3)
        qkv = hnn.Linear.init(
            In=config.Embed,
            Out=(Qkv, config.Heads, config.HeadSize),
            key=k_qkv,
            use_bias=config.use_bias,
        )
        out = _residual_projection(config, (config.Heads, config.HeadSize), key=k_out)
        return Gpt2Attention(qkv, out, config)

    def __call__(
        self,
        x: NamedArray,
        segment_ids: NamedArray | None = None,
        *,
        layer: jax.Array | None = None,
        key: PRNGKeyArray | None = None,
    ) -> NamedArray:
        """``layer`` (this block's index) scales the scores by ``1 / (layer + 1)``; ``key``
        drops out attention probabilities (``attn_pdrop``)."""
        k_qkv, k_out = adapter_keys(key, 2)
        qkv = self.qkv(x, key=k_qkv)
        qkv = name_activation(qkv, "qkv")
        q, k, v = _scaled(qkv["qkv", 0], layer), qkv["qkv", 1], qkv["qkv", 2]
        out = model_attention(self.config, q, k, v, segment_ids, key=key)
        return self.out(name_activation(out, "attn_out"), key=k_out)

    def decode(self, x: NamedArray, cache_k, cache_v, start, layer: jax.Array | None = None):
        """Attention over the cache for new positions from ``start``; returns the new cache too."""
        qkv = self.qkv(x)
        q, k, v = _scaled(qkv["qkv", 0], layer), qkv["qkv", 1], qkv["qkv", 2]
        if context_ways() > 1:  # a split prompt (models/decoding/split_prefill.py)
            out, cache_k, cache_v = split_prefill_attention(self.config, q, k, v, cache_k, cache_v)
        else:
            out, cache_k, cache_v = cached_attention(q, k, v, cache_k, cache_v, start)
        return self.out(out), cache_k, cache_v


def _scaled(q: NamedArray, layer: jax.Array | None) -> NamedArray:
    """Queries of layer ``layer`` divided by ``layer + 1`` (``scale_attn_by_inverse_layer_idx``)."""
    if layer is None:
        return q
    return q * (1.0 / (layer + 1).astype(jnp.float32)).astype(q.dtype)


class Gpt2Mlp(eqx.Module):
    """Two linear layers with ``activation_function`` (tanh-approximated GELU) between them."""

    up: hnn.Linear
    down: hnn.Linear
    act: str = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2ModelConfig, *, key: PRNGKeyArray) -> Gpt2Mlp:
        k_up, k_down = jax.random.split(key)
        up = hnn.Linear.init(In=config.Embed, Out=config.Mlp, key=k_up, use_bias=config.use_bias)
        down = _residual_projection(config, config.Mlp, key=k_down)
        return Gpt2Mlp(up, down, config.activation_function)

    def __call__(self, x: NamedArray, *, key: PRNGKeyArray | None = None) -> NamedArray:
        """``key`` (training) drives the LoRA adapters' dropout (``models/lora``)."""
        k_up, k_down = adapter_keys(key, 2)
        up = name_activation(self.up(x, key=k_up), "mlp_up")
        return self.down(activation(self.act)(up), key=k_down)


class Gpt2Block(eqx.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    ln_attn: hnn.LayerNorm
    attn: Gpt2Attention
    ln_mlp: hnn.LayerNorm
    mlp: Gpt2Mlp
    config: Gpt2ModelConfig = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2ModelConfig, *, key: PRNGKeyArray) -> Gpt2Block:
        k_attn, k_mlp = jax.random.split(key)
        eps = config.layer_norm_epsilon
        return Gpt2Block(
            layer_norm(config.Embed, eps),
            Gpt2Attention.init(config, key=k_attn),
            layer_norm(config.Embed, eps),
            Gpt2Mlp.init(config, key=k_mlp),
            config,
        )

    def __call__(
        self,
        x: NamedArray,
        segment_ids: NamedArray | None = None,
        *,
        key: PRNGKeyArray | None = None,
        layer: jax.Array | None = None,
    ) -> NamedArray:
        """``key`` (training) drives this block's dropout; ``layer`` is its index (when the
        scores are scaled by it)."""
        k_probs, k_attn, k_mlp = split(key, 3)
        rate = self.config.resid_pdrop
        attn = taps.tap(
            "attn_out", self.attn(self.ln_attn(x), segment_ids, layer=layer, key=k_probs)
        )
        x = x + dropout(attn, rate, k_attn)
        mlp_in = taps.tap("mlp_in", name_activation(self.ln_mlp(x), "mlp_in"))
        x = x + dropout(taps.tap("mlp_out", self.mlp(mlp_in, key=k_mlp)), rate, k_mlp)
        return hax.auto_sharded(x)  # keep activations laid out by the compute mapping

    def decode(
        self, x: NamedArray, cache: KvCache, start, layer: jax.Array | None = None
    ) -> tuple[NamedArray, KvCache]:
        attn, k, v = self.attn.decode(self.ln_attn(x), cache.k, cache.v, start, layer)
        x = x + attn
        return x + self.mlp(self.ln_mlp(x)), KvCache(k, v)


class Gpt2LmModel(LmModel):
    """Embeddings, a scanned stack of blocks, a final LayerNorm and the LM head."""

    config: Gpt2ModelConfig = eqx.field(static=True)
    token_embeddings: hnn.Embedding
    position_embeddings: hnn.Embedding
    blocks: hnn.Stacked[Gpt2Block]
    ln_final: hnn.LayerNorm
    lm_head: hnn.Linear | None

    @staticmethod
    def init(config: Gpt2ModelConfig, Vocab: Axis, *, key: PRNGKeyArray) -> Gpt2LmModel:
        k_tok, k_pos, k_blocks, k_head = jax.random.split(key, 4)
        std = config.initializer_range
        tokens = hnn.Embedding(_normal(k_tok, (Vocab, config.Embed), std), Vocab, config.Embed)
        positions = hnn.Embedding(
            _normal(k_pos, (config.Pos, config.Embed), std / 2), config.Pos, config.Embed
        )
        blocks = hnn.Stacked.init(
            config.Layers, Gpt2Block, gradient_checkpointing=config.remat_policy
        )(config, key=jax.random.split(k_blocks, config.num_layers))
        ln_final = layer_norm(config.Embed, config.layer_norm_epsilon)
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = hnn.Linear.init(In=config.Embed, Out=Vocab, key=k_head, use_bias=False)
        return Gpt2LmModel(config, tokens, positions, blocks, ln_final, lm_head)

    @property
    def Vocab(self) -> Axis:
        return self.token_embeddings.Vocab

    def hidden_states(
        self,
        tokens: NamedArray,
        *,
        segment_ids: NamedArray | None = None,
        key: PRNGKeyArray | None = None,
    ) -> NamedArray:
        c = self.config
        Pos = tokens.resolve_axis(Position)
        x = self.token_embeddings.embed(tokens)
        if c.document_positions and segment_ids is not None:  # each document's own, from 0
            positions = token_positions(Pos, segment_ids, True)
            x = x + self.position_embeddings.weight.take(Position, positions)
        elif context_ways() > 1:  # the sequence laid out zig-zag: each slot's true position
            x = x + self.position_embeddings.weight.take(Position, layout_positions(Pos))
        else:
            x = x + self.position_embeddings.weight[Position, hax.dslice(0, Pos.size)]
        k_embed, k_layers = split(key if c.dropout_active else None, 2)
        x = dropout(hax.auto_sharded(x), c.embed_pdrop, k_embed)
        per_layer = layer_inputs(
            c.num_layers, key=k_layers, layer_index=c.scale_attn_by_inverse_layer_idx
        )
        x = run_layers(
            self.blocks,
            x,
            segment_ids,
            scan=c.scan_layers,
            unroll=c.scan_unroll,
            per_layer=per_layer,
        )
        return taps.tap("final", self.final_hidden(x))

    def final_hidden(self, x: NamedArray) -> NamedArray:
        """The final LayerNorm of the stack's output (the loss's tail under 1F1B & co)."""
        return self.ln_final(x)

    def init_cache(self, batch_axes, max_len: int, dtype) -> KvCache:
        c = self.config
        axes = (c.Layers, *batch_axes, Axis(KeyPosition, max_len), c.Heads, c.HeadSize)
        return KvCache(hax.zeros(axes, dtype), hax.zeros(axes, dtype))

    def decode(self, tokens: NamedArray, cache: KvCache, start) -> tuple[NamedArray, KvCache]:
        Pos = tokens.resolve_axis(Position)
        x = self.token_embeddings.embed(tokens)
        if (
            context_ways() > 1
        ):  # a split prompt, zig-zag laid out (models/decoding/split_prefill.py)
            last = self.config.Pos.size - 1  # padding past the table: any row
            at = hax.minimum(layout_positions(Pos) + start, last)
            x = x + self.position_embeddings.weight.take(Position, at)
        else:
            x = x + self.position_embeddings.weight[Position, hax.dslice(start, Pos.size)]

        by_layer = self.config.scale_attn_by_inverse_layer_idx
        x, cache = decode_layers(x, [self.blocks], cache, start, layer_index=by_layer)
        return self.ln_final(x), cache

    def lm_head_weight(self) -> NamedArray:
        if self.lm_head is None:
            return self.token_embeddings.weight
        return self.lm_head.weight
