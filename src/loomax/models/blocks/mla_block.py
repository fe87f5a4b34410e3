"""Decoder blocks with multi-head latent attention (DeepSeek-V3's): pre-norm, MLA, then a
dense gated MLP (``MlaDenseBlock``, DeepSeek's first dense layers) or the mixture of experts
(``MlaMoeBlock``, whose carry is ``(x, RouterAux)`` as the Mixtral block's). Their config is
the ``deepseek_v3`` family's (``mla``, ``moe``, the Llama decoder's fields); decoding reads and
writes one layer's ``MlaCache`` (the latent and the rotary key).
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
from haliax import NamedArray
from jaxtyping import PRNGKeyArray

from loomax.models.attention.mla import MlaAttention
from loomax.models.attention.mla_cache import MlaCache
from loomax.models.blocks import taps
from loomax.models.blocks.decoder import LlamaMlp
from loomax.models.blocks.dropout import dropout, split
from loomax.models.blocks.remat import name_activation
from loomax.models.moe.moe import MoeMlp
from loomax.models.moe.moe_routing import RouterAux


def _attention(block, x: NamedArray, segment_ids, key) -> NamedArray:
    """``x`` plus the block's attention of its normed self (residual dropout with ``key``)."""
    k_probs, k_attn = split(key, 2)
    attn = taps.tap("attn_out", block.attn(block.input_norm(x), segment_ids, key=k_probs))
    return x + dropout(attn, block.config.resid_pdrop, k_attn)


def _mlp_input(block, x: NamedArray) -> NamedArray:
    return taps.tap("mlp_in", name_activation(block.post_attn_norm(x), "mlp_in"))


class MlaDenseBlock(eqx.Module):
    """Pre-norm block with MLA and a dense gated MLP (the first ``moe.first_dense_layers``)."""

    input_norm: hnn.RmsNorm
    attn: MlaAttention
    post_attn_norm: hnn.RmsNorm
    mlp: LlamaMlp
    config: Any = eqx.field(static=True)

    @staticmethod
    def init(config: Any, *, key: PRNGKeyArray) -> MlaDenseBlock:
        k_attn, k_mlp = jax.random.split(key)
        c = config
        attn = MlaAttention.init(c.mla, c, key=k_attn, out_scale=1 / math.sqrt(2 * c.num_layers))
        mlp = LlamaMlp.init(c, key=k_mlp)
        return MlaDenseBlock(c.make_norm(c.Embed), attn, c.make_norm(c.Embed), mlp, c)

    def __call__(self, x, segment_ids=None, *, key=None, layer=None) -> NamedArray:
        """``key`` (training) drives this block's dropout; ``layer`` is not read."""
        k_attn, k_mlp = split(key, 2)
        x = _attention(self, x, segment_ids, k_attn)
        mlp = taps.tap("mlp_out", self.mlp(_mlp_input(self, x)))
        return hax.auto_sharded(x + dropout(mlp, self.config.resid_pdrop, k_mlp))

    def decode(self, x: NamedArray, cache: MlaCache, start) -> tuple[NamedArray, MlaCache]:
        attn, cache = self.attn.decode(self.input_norm(x), cache, start)
        x = x + attn
        return x + self.mlp(self.post_attn_norm(x)), cache


class MlaMoeBlock(eqx.Module):
    """Pre-norm block with MLA and the DeepSeek-routed experts; the carry is ``(x, aux)``."""

    input_norm: hnn.RmsNorm
    attn: MlaAttention
    post_attn_norm: hnn.RmsNorm
    mlp: MoeMlp
    config: Any = eqx.field(static=True)

    @staticmethod
    def init(config: Any, *, key: PRNGKeyArray) -> MlaMoeBlock:
        k_attn, k_mlp = jax.random.split(key)
        c, scale = config, 1 / math.sqrt(2 * config.num_layers)
        attn = MlaAttention.init(c.mla, c, key=k_attn, out_scale=scale)
        mlp = MoeMlp.init(c.moe, c.Embed, c.intermediate_dim, c.activation_function, scale, key=k_mlp)  # fmt: skip
        return MlaMoeBlock(c.make_norm(c.Embed), attn, c.make_norm(c.Embed), mlp, c)

    def __call__(
        self, carry: tuple[NamedArray, RouterAux], segment_ids=None, *, key=None, layer=0
    ) -> tuple[NamedArray, RouterAux]:
        """``key`` (training) drives this block's dropout; ``layer`` is its row in ``aux``."""
        x, aux = carry
        k_attn, k_mlp = split(key, 2)
        x = _attention(self, x, segment_ids, k_attn)
        mlp, aux = self.mlp(_mlp_input(self, x), aux, layer)
        x = x + dropout(taps.tap("mlp_out", mlp), self.config.resid_pdrop, k_mlp)
        return hax.auto_sharded(x), aux

    def decode(self, x: NamedArray, cache: MlaCache, start) -> tuple[NamedArray, MlaCache]:
        attn, cache = self.attn.decode(self.input_norm(x), cache, start)
        x = x + attn
        return x + self.mlp(self.post_attn_norm(x))[0], cache
