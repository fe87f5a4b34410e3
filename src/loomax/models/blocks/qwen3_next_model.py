"""Qwen3-Next's model (``Qwen3NextForCausalLM``): a hybrid stack of Gated DeltaNet layers
(``gated_deltanet.py``) and gated full-attention layers, each followed by a mixture of
experts with a sigmoid-gated shared expert.

Parameters are plain arrays in a dict keyed by the Hugging Face tensor names (HF's
``[out, in]`` layouts), so import and export are name for name; the routed experts are
stacked per layer (``...mlp.experts.{gate,up,down}_proj``, ``[experts, in, out]``). The layers run one after
another in Python (their kinds differ: no layer scan), each under the model's remat policy
(``gradient_checkpointing`` as the layer scan's; not ``nested``; of the
named activations only the experts' are marked). Full-attention layers:
``q_proj`` gives the queries and an output gate per head (``sigmoid``, times the attention's
output), per-head zero-centred RMSNorm (``1 + w``) on queries and keys, rotary on the first
``partial_rotary_factor`` of each head. Every RMSNorm of the model is zero-centred; the gated
norm inside the DeltaNet layer is not (as transformers has it). The routed experts run through ``models/moe`` (dropless grouped matmul, router statistics and
balance losses as the other MoE families); a config without experts (``has_experts``
false: dense Qwen3.5) has a SwiGLU MLP (``mlp.{gate,up,down}_proj``) in every layer instead.

Decoding carries a ``HybridCache``: keys and values for the full layers (``max_len``
positions) and the conv + recurrent state for the linear ones (constant in the position).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jax.ad_checkpoint import checkpoint_name

from loomax.models.axes import Embed, Experts, Mlp
from loomax.models.blocks.gated_deltanet import DeltaCache, GatedDeltaNet
from loomax.models.config import AuxOutputs, LmModel
from loomax.models.layers import CARRY, INPUT
from loomax.models.moe.moe import MoeMlp
from loomax.models.moe.moe_routing import RouterAux


class HybridCache(NamedTuple):
    """Per layer: ``(k, v)`` ``[B, max_len, kv_heads, head_dim]`` for a full layer, a
    ``DeltaCache`` for a linear one."""

    layers: tuple


def _layer(model, carry, i: int, seg, pos, causal, lead):
    """``model._layer`` as a plain function (checkpointed with ``model`` an input)."""
    return model._layer(carry, i, seg, pos, causal, lead)


def zc_norm(x, w, eps):
    """Qwen3-Next's RMSNorm: ``x / rms(x) * (1 + w)``, in float32."""
    x32 = x.astype(jnp.float32)
    out = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
    return (out * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _rotary(x, positions, theta: float, rot: int):
    """Rotary (half-split) on the first ``rot`` dims of ``x [B, T, H, d]``."""
    inv = 1.0 / theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot)
    ang = positions[..., None].astype(jnp.float32) * inv  # [B, T, rot/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None].astype(x.dtype)
    xr, rest = x[..., :rot], x[..., rot:]
    half = jnp.concatenate([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
    return jnp.concatenate([xr * cos + half * sin, rest], -1)


class Qwen3NextLmModel(LmModel):
    """Embeddings, the hybrid layers, the final norm and the LM head (see the module docstring)."""

    config: Any = eqx.field(static=True)
    params: dict[str, NamedArray]  # axes: embed on the hidden dimension, experts
    vocab_size: int = eqx.field(static=True)
    recurrent_state: bool = eqx.field(static=True, default=True)  # prefill the prompt exactly

    @property
    def Vocab(self) -> Axis:
        return Axis("vocab", self.vocab_size)

    def _p(self, name: str) -> jax.Array:
        return self.params[name].array

    def _delta(self, i: int) -> GatedDeltaNet:
        c, p = self.config, f"model.layers.{i}.linear_attn."
        return GatedDeltaNet(
            self._p(p + "in_proj_qkvz.weight").T, self._p(p + "in_proj_ba.weight").T,
            self._p(p + "conv1d.weight")[:, 0].T, self._p(p + "dt_bias"), self._p(p + "A_log"),
            self._p(p + "norm.weight"), self._p(p + "out_proj.weight").T,
            c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim,
            c.linear_chunk, c.rms_norm_eps,
        )  # fmt: skip

    def _qkv(self, i: int, x, positions):
        c, p = self.config, f"model.layers.{i}.self_attn."
        B, T, _ = x.shape
        H, K, d = c.num_heads, c.num_kv_heads, c.head_dim
        qg = (x @ self._p(p + "q_proj.weight").T).reshape(B, T, H, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(B, T, H * d)
        k = (x @ self._p(p + "k_proj.weight").T).reshape(B, T, K, d)
        v = (x @ self._p(p + "v_proj.weight").T).reshape(B, T, K, d)
        q, k = (
            zc_norm(q, self._p(p + "q_norm.weight"), c.rms_norm_eps),
            zc_norm(k, self._p(p + "k_norm.weight"), c.rms_norm_eps),
        )
        rot = c.rotary_dim
        q, k = _rotary(q, positions, c.rope_theta, rot), _rotary(k, positions, c.rope_theta, rot)
        return q, k, v, gate

    def _attend(self, i: int, q, k, v, gate, mask):
        """Softmax attention of ``q [B, T, H, d]`` over ``k``/``v`` ``[B, S, K, d]`` (``mask
        [B, T, S]``), gated and projected."""
        c = self.config
        r = c.num_heads // c.num_kv_heads
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(c.head_dim)
        s = jnp.where(mask[:, None], s, jnp.finfo(s.dtype).min)
        o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
        o = o.reshape(*o.shape[:2], -1) * jax.nn.sigmoid(gate)
        return o @ self._p(f"model.layers.{i}.self_attn.o_proj.weight").T

    def _moe(self, i: int, x, lead: tuple[Axis, Axis], aux=None, row: int = 0):
        """The routed experts (``models/moe``: dropless grouped matmul, each device its own
        tokens, split as ``lead``, the tokens' axes, are) plus the shared expert times
        ``sigmoid(shared_expert_gate(x))``; ``aux`` gets router row ``row``."""
        c, p = self.config, f"model.layers.{i}.mlp."
        if not c.has_experts:  # dense Qwen3.5: a SwiGLU MLP in every layer
            return self._mlp(p, x), aux
        E = Axis(Experts, c.moe.num_experts)
        D, M = Axis(Embed, x.shape[-1]), Axis(Mlp, c.expert_dim)
        router = hnn.Linear(hax.named(self._p(p + "gate.weight"), (E, D)), None, E, D)
        stacked = [self._p(f"{p}experts.{n}") for n in ("gate_proj", "up_proj", "down_proj")]
        gate, up = (hax.named(w, (E, D, M)) for w in stacked[:2])
        down = hax.named(stacked[2], (E, M, D))
        moe = MoeMlp(router, gate, up, down, None, None, None, None, c.moe, "silu")
        out, aux = moe(hax.named(x, (*lead, D)), aux, row)
        shared = self._mlp(p + "shared_expert.", x)
        gated = jax.nn.sigmoid(x @ self._p(p + "shared_expert_gate.weight").T) * shared
        return out.rearrange((*lead, D)).array + gated, aux

    def _mlp(self, p: str, x):
        gate, up = x @ self._p(p + "gate_proj.weight").T, x @ self._p(p + "up_proj.weight").T
        return (jax.nn.silu(gate) * up) @ self._p(p + "down_proj.weight").T

    @staticmethod
    def _lead(tokens: NamedArray, rows: int) -> tuple[Axis, Axis]:
        """The ``[rows, positions]`` axes: the tokens' own when they are ``(batch, position)``."""
        return tokens.axes if tokens.ndim == 2 else (Axis("rows", rows), tokens.axes[-1])

    def _flat(self, tokens: NamedArray):
        T = tokens.axes[-1].size
        return tokens.array.reshape(-1, T)

    def _unflat(self, h, tokens: NamedArray) -> NamedArray:
        out = h.reshape(*tokens.array.shape, h.shape[-1])
        return hax.named(out, (*tokens.axes, Axis("embed", h.shape[-1])))

    def hidden_states(self, tokens, *, segment_ids=None, key=None) -> NamedArray:
        return self.hidden_states_and_aux(tokens, segment_ids=segment_ids, key=key)[0]

    def hidden_states_and_aux(
        self, tokens, *, segment_ids=None, key=None
    ) -> tuple[NamedArray, AuxOutputs]:
        """Final activations and the routers' balance losses and metrics (``RouterAux``)."""
        c = self.config
        aux = RouterAux.zeros(c.num_layers, c.moe.num_experts)
        ids = self._flat(tokens)
        B, T = ids.shape
        seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else self._flat(segment_ids)
        x = self._p("model.embed_tokens.weight")[ids]
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        causal = jnp.tril(jnp.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :])
        seg = None if segment_ids is None else seg
        layer = c.remat_policy.checkpoint(CARRY, INPUT, _layer)  # remat: as the layer scan's
        for i in range(c.num_layers):
            x, aux = layer(self, (x, aux), i, seg, pos, causal, self._lead(tokens, B))
        x = zc_norm(x, self._p("model.norm.weight"), c.rms_norm_eps)
        if not c.has_experts:
            return self._unflat(x, tokens), AuxOutputs()
        losses = aux.losses(c.moe.load_balance_loss_weight, c.moe.router_z_loss_weight)
        return self._unflat(x, tokens), AuxOutputs(losses, aux.metrics(), {})

    def _layer(self, carry, i: int, seg, pos, causal, lead):
        """Layer ``i`` of the training forward: ``(x, aux)`` in and out."""
        c, p = self.config, f"model.layers.{i}."
        x, aux = jax.tree.map(lambda a: checkpoint_name(a, CARRY), carry)
        h = zc_norm(x, self._p(p + "input_layernorm.weight"), c.rms_norm_eps)
        if c.layer_kinds[i] == "linear_attention":
            h = self._delta(i)(h, seg)
        else:
            q, k, v, gate = self._qkv(i, h, pos)
            h = self._attend(i, q, k, v, gate, causal)
        x = x + h
        mlp_in = zc_norm(x, self._p(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
        mlp, aux = self._moe(i, mlp_in, lead, aux, i)
        return x + mlp, aux

    def init_cache(self, batch_axes, max_len: int, dtype) -> HybridCache:
        c = self.config
        B = math.prod(a.size for a in batch_axes)
        layers = []
        for i, kind in enumerate(c.layer_kinds):
            if kind == "linear_attention":
                layers.append(self._delta(i).init_cache(B, dtype))
            else:
                shape = (B, max_len, c.num_kv_heads, c.head_dim)
                layers.append((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
        return HybridCache(tuple(layers))

    def decode(
        self, tokens: NamedArray, cache: HybridCache, start
    ) -> tuple[NamedArray, HybridCache]:
        """Positions ``start, start + 1, ...``: full layers write their keys and values into
        the cache at those positions; linear layers step their state one position at a time."""
        c = self.config
        ids = self._flat(tokens)
        B, T = ids.shape
        x = self._p("model.embed_tokens.weight")[ids]
        pos = jnp.broadcast_to(jnp.arange(T) + start, (B, T))
        new = []
        for i, kind in enumerate(c.layer_kinds):
            p = f"model.layers.{i}."
            h = zc_norm(x, self._p(p + "input_layernorm.weight"), c.rms_norm_eps)
            if kind == "linear_attention":
                net = self._delta(i)

                def step(state, xt, net=net):
                    out, state = net.decode(xt[:, None], state)
                    return state, out[:, 0]

                state, outs = jax.lax.scan(step, cache.layers[i], jnp.moveaxis(h, 1, 0))
                h = jnp.moveaxis(outs, 0, 1)
                new.append(DeltaCache(*state))
            else:
                q, k, v, gate = self._qkv(i, h, pos)
                ck, cv = cache.layers[i]
                ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), start, 1)
                cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), start, 1)
                S = ck.shape[1]
                mask = jnp.arange(S)[None, None, :] <= pos[:, :, None]
                h = self._attend(i, q, ck.astype(q.dtype), cv.astype(q.dtype), gate, mask)
                new.append((ck, cv))
            x = x + h
            mlp_in = zc_norm(x, self._p(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            x = x + self._moe(i, mlp_in, self._lead(tokens, B))[0]
        x = zc_norm(x, self._p("model.norm.weight"), c.rms_norm_eps)
        return self._unflat(x, tokens), HybridCache(tuple(new))

    def lm_head_weight(self) -> NamedArray:
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        w = self._p(name)
        return hax.named(w, (self.Vocab, Axis("embed", w.shape[1])))
