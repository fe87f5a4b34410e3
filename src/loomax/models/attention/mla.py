"""Multi-head latent attention (MLA), as DeepSeek-V2/V3 define it (transformers' ``deepseek_v3``).

Queries go through an optional low-rank bottleneck (``q_lora_rank``: ``q_a_proj``, an RMSNorm,
``q_b_proj``; without it one ``q_proj``). Keys and values come from one compressed latent of
``kv_lora_rank`` per token (``kv_a_proj`` then an RMSNorm) that ``kv_b_proj`` expands into each
head's non-rotary key (``qk_nope_head_dim``) and value (``v_head_dim``); ``kv_a_proj`` also
yields one rotary key of ``qk_rope_head_dim`` shared by every head. A head's query and key are
``[nope, rope]`` (``qk_nope + qk_rope`` wide), its value ``v_head_dim`` wide. Scores are scaled
by ``(qk_nope + qk_rope) ** -0.5``, times YaRN's ``m(mscale_all_dim) ** 2`` when the rope is
YaRN with ``mscale_all_dim`` (DeepSeek-V3 ships factor 40, so 1.369 ** 2). ``rope_interleave``
(DeepSeek's checkpoints) rotates adjacent pairs: the rotary dims are de-interleaved first, the
same permutation for queries and keys, so scores are unchanged.

Training runs through ``model_attention`` (every backend: ``vanilla``, ``blockwise``, ``xla``,
``cudnn``, ``splash``): where the q.k and v head dims differ, the narrower side is zero-padded
to the wider (zeros add nothing to a score or an output) and the output cut back. Under context
parallelism (``trainer.mesh.context > 1``) the ring carries the padded per-head keys and
values like any other attention's; rotary positions are the zig-zag layout's true ones.
Decoding caches only the latent and the rotary key (``mla_cache.py``, the up-projections
absorbed); a decode split over ``context`` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jaxtyping import PRNGKeyArray

from loomax.config import ConfigError
from loomax.models.attention.attention import AttentionSettings, model_attention
from loomax.models.attention.mla_cache import (
    KvLora,
    MlaCache,
    QkNope,
    VHead,
    absorbed_attention,
    init_mla_cache,
)
from loomax.models.attention.rotary import RotaryConfig, YarnRotary, apply_rotary
from loomax.models.attention.sequence_layout import context_ways, token_positions
from loomax.models.axes import Embed, Heads, HeadSize, Position
from loomax.models.blocks.norms import rms_norm


def _deepseek_v3_rope() -> RotaryConfig:
    return YarnRotary(
        theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
    )  # fmt: skip


@dataclass(frozen=True)
class MlaConfig:
    """Shapes of multi-head latent attention; the defaults are DeepSeek-V3's (671B).

    Not yet reachable from a run config: the ``deepseek_v3`` family will carry one."""

    hidden_dim: int = 7168
    """Width of the residual stream (``hidden_size``)."""
    num_heads: int = 128
    """Attention heads (``num_attention_heads``)."""
    q_lora_rank: int | None = 1536
    """Rank of the query bottleneck; None: one full ``q_proj`` (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent, the cached part."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without rotary positions."""
    qk_rope_head_dim: int = 64
    """Per-head query dims with rotary positions; the rotary key is shared by all heads."""
    v_head_dim: int = 128
    """Per-head value dims."""
    rope: RotaryConfig = field(default_factory=_deepseek_v3_rope)
    """Rotary frequencies of the ``qk_rope`` dims (YaRN's ``mscale_all_dim`` sets the softmax
    temperature)."""
    rope_interleave: bool = True
    """Rotary pairs are adjacent dims (DeepSeek's checkpoints) rather than the two halves."""
    norm_eps: float = 1e-6
    """Epsilon of the query and latent RMSNorms."""
    attention_bias: bool = False
    """Biases on ``q_a_proj``, ``kv_a_proj`` and ``o_proj`` (``attention_bias``)."""

    def __post_init__(self):
        sizes = [self.hidden_dim, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim]
        sizes += [self.qk_nope_head_dim, self.v_head_dim, self.q_lora_rank or 1]
        if min(sizes) < 1 or self.qk_rope_head_dim % 2:
            raise ConfigError(
                "MLA sizes must be positive and qk_rope_head_dim even, got "
                f"{self.hidden_dim=} {self.num_heads=} {self.q_lora_rank=} {self.kv_lora_rank=} "
                f"{self.qk_nope_head_dim=} {self.qk_rope_head_dim=} {self.v_head_dim=}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``m(mscale_all_dim) ** 2`` under DeepSeek's YaRN."""
        scale = self.qk_head_dim**-0.5
        if isinstance(self.rope, YarnRotary) and self.rope.mscale_all_dim:
            scale *= self.rope.mscale_of(self.rope.mscale_all_dim) ** 2
        return scale

    def axes(self) -> dict[str, Axis]:
        """The named axes of the weights."""
        return {
            "embed": Axis(Embed, self.hidden_dim),
            "heads": Axis(Heads, self.num_heads),
            "q_lora": Axis("q_lora", self.q_lora_rank or 1),
            "kv_lora": Axis(KvLora, self.kv_lora_rank),
            "qk_head": Axis(HeadSize, self.qk_head_dim),
            "kv_a": Axis("kv_a", self.kv_lora_rank + self.qk_rope_head_dim),
            "kv_b": Axis("kv_b", self.qk_nope_head_dim + self.v_head_dim),
            "v_head": Axis(VHead, self.v_head_dim),
        }

    def init_cache(self, batch_axes, max_len: int, dtype, layers: Axis | None = None) -> MlaCache:
        """An empty decode cache: the latent and the rotary key per position."""
        args = (self.kv_lora_rank, self.qk_rope_head_dim, dtype, layers)
        return init_mla_cache(tuple(batch_axes), max_len, *args)


def _refuse_split_decoding() -> None:
    if context_ways() > 1:
        raise ConfigError(
            "trainer.mesh.context > 1 is not supported when decoding multi-head latent "
            "attention (no split prefill over the latent cache yet): decode with context 1"
        )


def _pad_head(x: NamedArray, size: int) -> NamedArray:
    """``x`` zero-padded along ``head_size`` to ``size``."""
    axis = x.axes.index(x.resolve_axis(HeadSize))
    extra = size - x.array.shape[axis]
    if extra == 0:
        return x
    widths = [(0, extra if i == axis else 0) for i in range(x.array.ndim)]
    axes = tuple(a.resize(size) if a.name == HeadSize else a for a in x.axes)
    return hax.named(jnp.pad(x.array, widths), axes)


class MlaAttention(eqx.Module):
    """DeepSeek-V3's multi-head latent attention on named axes; weight layouts match
    transformers' ``DeepseekV3Attention`` (each ``nn.Linear``'s rows split into the output
    axes)."""

    q_proj: hnn.Linear | None  # embed -> (heads, head_size), without q_lora_rank
    q_a_proj: hnn.Linear | None  # embed -> q_lora
    q_a_norm: hnn.RmsNorm | None
    q_b_proj: hnn.Linear | None  # q_lora -> (heads, head_size)
    kv_a_proj: hnn.Linear  # embed -> kv_a (kv_lora, then the rotary key)
    kv_a_norm: hnn.RmsNorm  # over kv_lora
    kv_b_proj: hnn.Linear  # kv_lora -> (heads, kv_b (qk_nope, then v_head))
    o_proj: hnn.Linear  # (heads, v_head) -> embed
    config: MlaConfig = eqx.field(static=True)
    settings: AttentionSettings = eqx.field(static=True)

    @staticmethod
    def init(
        config: MlaConfig,
        settings: AttentionSettings,
        *,
        key: PRNGKeyArray,
        out_scale: float = 1.0,
    ) -> MlaAttention:
        """Random weights; ``settings`` (a model config: ``attn_backend``, blocks, dropout,
        ``context_parallel``) picks the training backend; ``out_scale`` scales ``o_proj``'s
        init (``1 / sqrt(2 * layers)`` in the Llama-style decoder)."""
        ax, bias = config.axes(), config.attention_bias
        k = iter(jax.random.split(key, 6))
        Qk = (ax["heads"], ax["qk_head"])
        q_proj = q_a = q_norm = q_b = None
        if config.q_lora_rank is None:
            q_proj = hnn.Linear.init(ax["embed"], Qk, key=next(k), use_bias=False)
        else:
            q_a = hnn.Linear.init(ax["embed"], ax["q_lora"], key=next(k), use_bias=bias)
            q_norm = rms_norm(ax["q_lora"], config.norm_eps)
            q_b = hnn.Linear.init(ax["q_lora"], Qk, key=next(k), use_bias=False)
        return MlaAttention(
            q_proj, q_a, q_norm, q_b,
            hnn.Linear.init(ax["embed"], ax["kv_a"], key=next(k), use_bias=bias),
            rms_norm(ax["kv_lora"], config.norm_eps),
            hnn.Linear.init(ax["kv_lora"], (ax["heads"], ax["kv_b"]), key=next(k), use_bias=False),
            hnn.Linear.init(
                (ax["heads"], ax["v_head"]), ax["embed"], key=next(k), use_bias=bias,
                init_scale=out_scale,
            ),
            config,
            settings,
        )  # fmt: skip

    # ---------------------------------------------------------------- projections
    def _rotate(self, x: NamedArray, positions: NamedArray) -> NamedArray:
        """RoPE on ``x``'s ``head_size`` (de-interleaved first under ``rope_interleave``)."""
        if self.config.rope_interleave:
            D = x.resolve_axis(HeadSize)
            Pair, Parity = Axis("rope_pair", D.size // 2), Axis("rope_parity", 2)
            x = hax.unflatten_axis(x, D, (Pair, Parity)).rearrange((..., Parity, Pair))
            x = hax.flatten_axes(x, (Parity, Pair), D)
        return apply_rotary(x, positions, self.config.rope)

    def _queries(self, x: NamedArray, positions: NamedArray) -> tuple[NamedArray, NamedArray]:
        """``(q_nope (..., heads, qk_nope), q_rope (..., heads, head_size), rotated)``."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        nope = self.config.qk_nope_head_dim
        q_nope = q[HeadSize, :nope].rename({HeadSize: QkNope})
        return q_nope, self._rotate(q[HeadSize, nope:], positions)

    def _latents(self, x: NamedArray, positions: NamedArray) -> tuple[NamedArray, NamedArray]:
        """``(latent (..., kv_lora) normed, k_rope (..., head_size) rotated)``: what is cached."""
        kv = self.kv_a_proj(x)
        rank = self.config.kv_lora_rank
        latent = self.kv_a_norm(kv["kv_a", :rank].rename({"kv_a": KvLora}))
        k_rope = self._rotate(kv["kv_a", rank:].rename({"kv_a": HeadSize}), positions)
        return latent, k_rope

    # ---------------------------------------------------------------- training
    def __call__(
        self,
        x: NamedArray,
        segment_ids: NamedArray | None = None,
        *,
        key: PRNGKeyArray | None = None,
    ) -> NamedArray:
        """Causal self-attention of ``x`` (axes ``(..., position, embed)``) over itself;
        ``segment_ids`` keep packed documents apart, ``key`` drops out probabilities."""
        c = self.config
        Pos = x.resolve_axis(Position)  # zig-zag when split; per document if asked
        restart = getattr(self.settings, "document_positions", None)  # a model config's
        positions = token_positions(Pos, segment_ids, restart)
        q_nope, q_rope = self._queries(x, positions)
        latent, k_rope = self._latents(x, positions)
        kv = self.kv_b_proj(latent)
        nope = c.qk_nope_head_dim
        k_nope = kv["kv_b", :nope].rename({"kv_b": HeadSize})
        v = kv["kv_b", nope:].rename({"kv_b": HeadSize})
        k_rope = hax.broadcast_axis(k_rope, k_nope.resolve_axis(Heads))
        k_rope = k_rope.rearrange(tuple(a.name for a in k_nope.axes))
        q = hax.concatenate(HeadSize, [q_nope.rename({QkNope: HeadSize}), q_rope])
        k = hax.concatenate(HeadSize, [k_nope, k_rope])
        width = max(c.qk_head_dim, c.v_head_dim)  # one head size for every backend
        q, k, v = (_pad_head(t, width) for t in (q, k, v))
        out = model_attention(self.settings, q, k, v, segment_ids, key=key, scale=c.softmax_scale())
        out = out[HeadSize, : c.v_head_dim].rename({HeadSize: VHead})
        return self.o_proj(out)

    # ---------------------------------------------------------------- decoding
    def decode(
        self, x: NamedArray, cache: MlaCache, start: jax.Array
    ) -> tuple[NamedArray, MlaCache]:
        """Attention of new positions ``start, start + 1, ...`` over ``cache`` (one layer's),
        whose latent and rotary key are written at ``start``; the up-projections are
        absorbed into the query and the output (``mla_cache.absorbed_attention``)."""
        _refuse_split_decoding()
        c = self.config
        positions = hax.arange(x.resolve_axis(Position)) + start
        q_nope, q_rope = self._queries(x, positions)
        latent, k_rope = self._latents(x, positions)
        w = self.kv_b_proj.weight  # (heads, kv_b, kv_lora)
        w_uk = w["kv_b", : c.qk_nope_head_dim].rename({"kv_b": QkNope})
        w_uv = w["kv_b", c.qk_nope_head_dim :].rename({"kv_b": VHead})
        out, cache = absorbed_attention(
            q_nope, q_rope, latent, k_rope, w_uk, w_uv, cache, start, c.softmax_scale()
        )
        return self.o_proj(out), cache


__all__ = ["MlaAttention", "MlaConfig"]
