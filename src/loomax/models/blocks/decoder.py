"""The Llama-style decoder every rotary family builds on: attention, gated MLP, block, model.

Its config is a ``LlamaConfig`` or a family's subclass (``DecoderConfig`` names what is
read). The switches a family overrides: ``qkv_bias`` (biases on q/k/v alone, as Qwen 2),
``qk_norm_scope`` (QK-norm per head or over the whole projection, as OLMo 2), ``pre_norm``
(norms before the attention and MLP, or only after them, as OLMo 2) and the field
``sliding_window`` (Mistral) with its per-layer pattern (``layer_windows``: Gemma 2's
alternate layers, run as a ``lax.switch`` on the scanned layer index so that each kind of
layer skips what its window excludes), the attention's ``attn_scale`` and
``attn_logit_softcap``, ``scale_embeddings`` (by sqrt(hidden), Gemma) or ``embed_scale``,
``residual_scale`` (each block's attention and MLP outputs before the residual add) and
``logit_scale`` (the final hidden states, so the logits: Granite's multipliers) and the
optional ``layer_ropes`` (each layer's rotary where they differ: Gemma 3's base per layer
kind, switched on the layer index like the windows, so only with differing windows), and the
optional ``attention_sinks`` (a learned logit per head in the softmax's denominator: gpt-oss).
Weight layout and rotary convention match Hugging Face ``LlamaForCausalLM``.
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

from loomax.config import ConfigError
from loomax.models.attention.attention import cached_attention, model_attention
from loomax.models.attention.max_logits import stack_key
from loomax.models.attention.rotary import apply_rotary
from loomax.models.attention.sequence_layout import context_ways, layout_positions, token_positions
from loomax.models.axes import KeyPosition, Position
from loomax.models.blocks import pipeline, taps
from loomax.models.blocks.dropout import adapter_keys, dropout, split
from loomax.models.blocks.mlp_activations import activation
from loomax.models.blocks.remat import name_activation
from loomax.models.config import KvCache, LmModel
from loomax.models.decoding.rolling_cache import rolling_attention, uses_rolling
from loomax.models.decoding.split_prefill import split_prefill_attention
from loomax.models.decoding.stack import decode_layers
from loomax.models.layers import layer_inputs, run_layers


class DecoderConfig(Protocol):
    """What the decoder reads of its config: ``loomax.models.families.llama.LlamaConfig`` (or a family's
    subclass) provides it; named here so that this module needs no import of its config."""

    Embed: Axis
    Heads: Axis
    KvHeads: Axis
    HeadSize: Axis
    Mlp: Axis
    Layers: Axis
    num_layers: int
    hidden_dim: int
    rope: Any
    activation_function: str
    initializer_range: float
    tie_word_embeddings: bool
    use_bias: bool
    qkv_bias: bool
    qk_norm: bool
    qk_norm_scope: str
    pre_norm: bool
    hybrid_norm: bool
    input_embedding_norm: bool
    sliding_window: int | None
    document_positions: bool | None
    layer_windows: tuple[int | None, ...]
    attn_scale: float | None
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    scale_embeddings: bool
    embed_scale: float | None
    residual_scale: float | None
    logit_scale: float | None
    dropout_active: bool
    embed_pdrop: float
    resid_pdrop: float
    remat_policy: Any
    scan_layers: bool
    scan_unroll: int | bool

    def make_norm(self, axis) -> hnn.RmsNorm: ...


def _linear(In, Out, *, key: PRNGKeyArray, init_scale: float = 1.0, use_bias=False) -> hnn.Linear:
    return hnn.Linear.init(In=In, Out=Out, key=key, use_bias=use_bias, init_scale=init_scale)


class LlamaAttention(eqx.Module):
    """Grouped-query causal attention with rotary positions (optional QK-norm and sinks)."""

    q_proj: hnn.Linear  # embed -> (heads, head_size)
    k_proj: hnn.Linear  # embed -> (kv_heads, head_size)
    v_proj: hnn.Linear  # embed -> (kv_heads, head_size)
    o_proj: hnn.Linear  # (heads, head_size) -> embed
    q_norm: hnn.RmsNorm | None
    k_norm: hnn.RmsNorm | None
    config: DecoderConfig = eqx.field(static=True)
    sinks: NamedArray | None = None  # (heads,): config.attention_sinks

    @staticmethod
    def init(config: DecoderConfig, *, key: PRNGKeyArray) -> LlamaAttention:
        k_q, k_k, k_v, k_o = jax.random.split(key, 4)
        c, bias, qkv_bias = config, config.use_bias, config.qkv_bias
        q_norm = k_norm = None
        if c.qk_norm:
            per_head = c.qk_norm_scope == "head"
            q_norm = c.make_norm(c.HeadSize if per_head else (c.Heads, c.HeadSize))
            k_norm = c.make_norm(c.HeadSize if per_head else (c.KvHeads, c.HeadSize))
        out_scale = 1 / math.sqrt(2 * c.num_layers)
        sinks = hax.zeros(c.Heads) if getattr(c, "attention_sinks", False) else None
        return LlamaAttention(
            _linear(c.Embed, (c.Heads, c.HeadSize), key=k_q, use_bias=qkv_bias),
            _linear(c.Embed, (c.KvHeads, c.HeadSize), key=k_k, use_bias=qkv_bias),
            _linear(c.Embed, (c.KvHeads, c.HeadSize), key=k_v, use_bias=qkv_bias),
            _linear((c.Heads, c.HeadSize), c.Embed, key=k_o, init_scale=out_scale, use_bias=bias),
            q_norm,
            k_norm,
            config,
            sinks,
        )

    def _qkv(self, x: NamedArray, positions: NamedArray, layer=None, keys=(None, None, None)):
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (p(x, key=kp) for p, kp in zip(projections, keys, strict=True))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(self.config, q, k, positions, layer)
        return name_activation((q, k, v), "qkv")

    def __call__(
        self,
        x: NamedArray,
        segment_ids: NamedArray | None = None,
        *,
        key: PRNGKeyArray | None = None,
        layer: jax.Array | None = None,
    ) -> NamedArray:
        """``key`` drops out attention probabilities (``attn_pdrop``); ``layer`` (the block's
        index) picks its window where the layers' windows differ."""
        c = self.config
        k_q, k_k, k_v, k_o = adapter_keys(key, 4)
        positions = token_positions(x.resolve_axis(Position), segment_ids, c.document_positions)
        q, k, v = self._qkv(x, positions, layer, (k_q, k_k, k_v))

        def attend(window):
            return lambda q, k, v: model_attention(
                c, q, k, v, segment_ids, key=key, window=window,
                scale=c.attn_scale, softcap=c.attn_logit_softcap, sinks=self.sinks,
            )  # fmt: skip

        kinds = sorted(set(c.layer_windows), key=lambda w: -1 if w is None else w)
        if len(kinds) == 1:
            out = attend(kinds[0])(q, k, v)
        else:
            if layer is None:
                raise ConfigError(
                    f"model.sliding_window_pattern is not supported by {type(c).__name__}"
                )
            kind = jnp.asarray([kinds.index(w) for w in c.layer_windows])[layer]
            out = jax.lax.switch(kind, [attend(w) for w in kinds], q, k, v)
        return self.o_proj(name_activation(out, "attn_out"), key=k_o)

    def decode(self, x: NamedArray, cache_k, cache_v, start, layer=None, window="by_layer"):
        """Attention over the cache for new positions from ``start``; returns the new cache too.
        With ``position`` split over the context axis, a prefill of the whole cache from 0
        with the tokens zig-zag laid out (``models/decoding/split_prefill.py``). ``window``:
        the layer's, static (a cache per kind of layer, ``models/decoding/kind_cache.py``)."""
        c = self.config
        q, k, v = self._qkv(x, layout_positions(x.resolve_axis(Position)) + start, layer)
        if context_ways() > 1:  # any layer's window: refused there (full causal only)
            window = next((w for w in c.layer_windows if w is not None), None)
            scores = (window, c.attn_scale, c.attn_logit_softcap, self.sinks)
            out, cache_k, cache_v = split_prefill_attention(c, q, k, v, cache_k, cache_v, *scores)
            return self.o_proj(out), cache_k, cache_v
        if window == "by_layer":  # with windows that differ, a traced one: a mask only
            full, windows = jnp.iinfo(jnp.int32).max, c.layer_windows
            window = windows[0] if len(set(windows)) == 1 else jnp.asarray(
                [full if w is None else w for w in windows])[layer]  # fmt: skip
        attend = rolling_attention if uses_rolling(cache_k, window) else cached_attention
        scores = (window, c.attn_scale, c.attn_logit_softcap, self.sinks)
        out, cache_k, cache_v = attend(q, k, v, cache_k, cache_v, start, *scores)
        return self.o_proj(out), cache_k, cache_v


class LlamaMlp(eqx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with the default ``silu``."""

    gate_proj: hnn.Linear
    up_proj: hnn.Linear
    down_proj: hnn.Linear
    act: str = eqx.field(static=True)

    @staticmethod
    def init(config: DecoderConfig, *, key: PRNGKeyArray) -> LlamaMlp:
        k_gate, k_up, k_down = jax.random.split(key, 3)
        c, bias = config, config.use_bias
        down_scale = 1 / math.sqrt(2 * c.num_layers)
        return LlamaMlp(
            _linear(c.Embed, c.Mlp, key=k_gate, use_bias=bias),
            _linear(c.Embed, c.Mlp, key=k_up, use_bias=bias),
            _linear(c.Mlp, c.Embed, key=k_down, init_scale=down_scale, use_bias=bias),
            c.activation_function,
        )

    def __call__(self, x: NamedArray, *, key: PRNGKeyArray | None = None) -> NamedArray:
        """``key`` (training) drives the LoRA adapters' dropout (``models/lora``)."""
        k_gate, k_up, k_down = adapter_keys(key, 3)
        gate, up = self.gate_proj(x, key=k_gate), self.up_proj(x, key=k_up)
        gate, up = name_activation((gate, up), "mlp_up")
        return self.down_proj(activation(self.act)(gate) * up, key=k_down)


class LlamaBlock(eqx.Module):
    """Pre-norm block: x + attn(rms(x)), then x + mlp(rms(x)); with ``hybrid_norm`` the
    outputs are normed too: x + rms(attn(rms(x))), then x + rms(mlp(rms(x))); without
    ``pre_norm`` (OLMo 2) only the outputs: x + rms(attn(x)), then x + rms(mlp(x))."""

    input_norm: hnn.RmsNorm | None
    attn: LlamaAttention
    post_attn_norm: hnn.RmsNorm | None
    mlp: LlamaMlp
    attn_out_norm: hnn.RmsNorm | None
    mlp_out_norm: hnn.RmsNorm | None
    config: DecoderConfig = eqx.field(static=True)

    @staticmethod
    def init(config: DecoderConfig, *, key: PRNGKeyArray) -> LlamaBlock:
        k_attn, k_mlp = jax.random.split(key)
        c = config
        out_norm = c.hybrid_norm or not c.pre_norm
        out_norms = (c.make_norm(c.Embed), c.make_norm(c.Embed)) if out_norm else (None, None)
        pre_norm = c.make_norm(c.Embed) if c.pre_norm else None
        return LlamaBlock(
            pre_norm,
            LlamaAttention.init(config, key=k_attn),
            c.make_norm(c.Embed) if c.pre_norm else None,
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
        layer: jax.Array | None = None,
    ) -> NamedArray:
        """``key`` (training) drives this block's dropout; ``layer`` is its index."""
        k_probs, k_attn, k_mlp = split(key, 3)
        rate = self.config.resid_pdrop
        attn_in = _maybe(self.input_norm, x)
        attn = taps.tap("attn_out", self.attn(attn_in, segment_ids, key=k_probs, layer=layer))
        x = x + dropout(self._branch(self.attn_out_norm, attn), rate, k_attn)
        mlp_in = taps.tap("mlp_in", name_activation(_maybe(self.post_attn_norm, x), "mlp_in"))
        mlp = taps.tap("mlp_out", self.mlp(mlp_in, key=k_mlp))
        x = x + dropout(self._branch(self.mlp_out_norm, mlp), rate, k_mlp)
        return hax.auto_sharded(x)

    def decode(self, x: NamedArray, cache: KvCache, start, layer=None, **window):
        """One decode step (``window``: ``LlamaAttention.decode``'s)."""
        attn_in = _maybe(self.input_norm, x)
        attn, k, v = self.attn.decode(attn_in, cache.k, cache.v, start, layer, **window)
        x = x + self._branch(self.attn_out_norm, attn)
        mlp = self.mlp(_maybe(self.post_attn_norm, x))
        return x + self._branch(self.mlp_out_norm, mlp), KvCache(k, v)

    def _branch(self, norm: hnn.RmsNorm | None, out: NamedArray) -> NamedArray:
        """What the attention or MLP adds to the residual: its output, normed with
        ``hybrid_norm``, times ``residual_scale`` (Granite's ``residual_multiplier``)."""
        return _scaled(_maybe(norm, out), self.config.residual_scale)


def _rotate(c: DecoderConfig, q: NamedArray, k: NamedArray, positions: NamedArray, layer):
    """``q`` and ``k`` rotated by ``rope``, or where the config has ``layer_ropes`` that differ
    (Gemma 3: a base per layer kind) by the layer's own, a ``lax.switch`` on its index."""
    ropes = getattr(c, "layer_ropes", None) or (c.rope,)  # optional: Llama has none
    kinds = list(dict.fromkeys(ropes))

    def rotate(rope):
        return lambda q, k: (apply_rotary(q, positions, rope), apply_rotary(k, positions, rope))

    if len(kinds) == 1:
        return rotate(kinds[0])(q, k)
    if layer is None:
        raise ConfigError(f"{type(c).__name__}: layer_ropes that differ need windows that differ")
    kind = jnp.asarray([kinds.index(r) for r in ropes])[layer]
    return jax.lax.switch(kind, [rotate(r) for r in kinds], q, k)


def _maybe(norm: hnn.RmsNorm | None, x: NamedArray) -> NamedArray:
    return x if norm is None else norm(x)


def _scaled(x: NamedArray, scale: float | None) -> NamedArray:
    """``x`` times ``scale`` in its dtype (None: ``x`` itself)."""
    return x if scale is None else x * jnp.asarray(scale, x.dtype)


class LlamaLmModel(LmModel):
    """Token embeddings, a scanned stack of blocks, a final RMSNorm and the LM head."""

    config: DecoderConfig = eqx.field(static=True)
    embed_tokens: hnn.Embedding
    blocks: hnn.Stacked[LlamaBlock]
    norm: hnn.RmsNorm
    lm_head: hnn.Linear | None
    embed_norm: hnn.RmsNorm | None = None  # input_embedding_norm

    @staticmethod
    def init(config: DecoderConfig, Vocab: Axis, *, key: PRNGKeyArray) -> LlamaLmModel:
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
        x = pipeline.stack_input(lambda t: _maybe(self.embed_norm, self._embed(t)), tokens)
        k_embed, k_layers = split(key if c.dropout_active else None, 2)
        x = dropout(x, c.embed_pdrop, k_embed)
        mixed = len(set(c.layer_windows)) > 1
        per_layer = layer_inputs(c.num_layers, key=k_layers, layer_index=mixed)
        run = dict(scan=c.scan_layers, unroll=c.scan_unroll, per_layer=per_layer)
        x = run_layers(self.blocks, x, segment_ids, **run)
        return taps.tap("final", self.final_hidden(x))

    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.config.layer_windows)

    def init_cache(self, batch_axes, max_len: int, dtype) -> KvCache:
        c = self.config
        axes = (c.Layers, *batch_axes, Axis(KeyPosition, max_len), c.KvHeads, c.HeadSize)
        return KvCache(hax.zeros(axes, dtype), hax.zeros(axes, dtype))

    def decode(self, tokens: NamedArray, cache: KvCache, start) -> tuple[NamedArray, KvCache]:
        c = self.config
        x = _maybe(self.embed_norm, self._embed(tokens))
        by_layer = len(set(c.layer_windows)) > 1  # the layers' windows differ
        x, cache = decode_layers(x, self.decode_stacks(), cache, start, layer_index=by_layer)
        return self.final_hidden(x), cache

    def decode_stacks(self) -> list[hnn.Stacked]:
        """The stacks of blocks a decode step runs through, in order."""
        return [self.blocks]

    def qk_clip_attention(self) -> dict[str, Any]:
        """``{stack_key: getter of the stack's attention}`` for QK-clip (``optim/qk_clip.py``)."""
        return {stack_key(0): lambda m: m.blocks.stacked.attn}

    def _embed(self, tokens: NamedArray) -> NamedArray:
        """Token embeddings, times ``embed_scale`` (or sqrt(hidden) with ``scale_embeddings``)
        in their dtype."""
        c = self.config
        scale = math.sqrt(c.hidden_dim) if c.scale_embeddings else c.embed_scale
        return _scaled(self.embed_tokens.embed(tokens), scale)

    def final_hidden(self, x: NamedArray) -> NamedArray:
        """The final norm, times ``logit_scale`` (Granite: 1 / ``logits_scaling``): scaling the
        hidden states scales the logits wherever they are computed (loss, decoding)."""
        return _scaled(self.norm(x), self.config.logit_scale)

    @property
    def final_logit_softcap(self) -> float | None:
        return self.config.final_logit_softcap

    def lm_head_weight(self) -> NamedArray:
        if self.lm_head is None:
            return self.embed_tokens.weight
        return self.lm_head.weight
