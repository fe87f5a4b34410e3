"""Qwen3-Next (``Qwen3NextForCausalLM``, Qwen team 2025): a hybrid of Gated DeltaNet
(linear attention) and gated full-attention layers, each with a mixture of experts and a
sigmoid-gated shared expert.

``model.type: qwen3_next``; ``layer_types`` as transformers writes it (``linear_attention``
or ``full_attention`` per layer; default three linear to one full). Full layers: queries
with an output gate (``q_proj`` twice as wide, ``sigmoid``), per-head QK-norm, rotary on
``partial_rotary_factor`` of each head. Every RMSNorm is zero-centred (``1 + w``). The model
is ``models/blocks/qwen3_next_model.py``; its parameters carry the HF tensor names, so the HF
side is one entry per tensor. Dense layers (``decoder_sparse_step`` above 1,
``mlp_only_layers``), attention biases and rope scaling are refused on import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.models.blocks.qwen3_next_model import Qwen3NextLmModel
from loomax.models.config import LmConfig
from loomax.models.io.hf_layout import Param
from loomax.models.moe.moe import MoeConfig

KINDS = ("linear_attention", "full_attention")


def _param(name: str) -> Param:
    """The HF side of the model's ``params[name]`` (the stacked experts: one tensor each)."""
    where = lambda m: m.params[name]  # noqa: E731
    if ".mlp.experts." in name:
        return _Experts(
            f"{name.rsplit('.', 1)[0]}.{{e}}.{name.rsplit('.', 1)[1]}.weight", where, (), key=name
        )
    return _Tensor(name, where, ())


def _axes(name: str, shape: tuple[int, ...], hidden: int) -> tuple[str, ...]:
    """A parameter's axis names: ``embed`` on its hidden dimension (FSDP splits it),
    ``experts`` on the stacked experts' first; the rest unnamed roles (kept whole)."""
    names = [f"dim{k}" for k in range(len(shape))]
    if ".mlp.experts." in name:
        names[0] = "experts"
    embed = [k for k in range(len(shape)) if shape[k] == hidden and names[k] != "experts"]
    if embed:
        names[embed[-1]] = "embed"
    return tuple(names)


def _moe() -> MoeConfig:
    return MoeConfig(num_experts=512, num_experts_per_tok=10, norm_topk_prob=True)


@dataclass(frozen=True)
class _Tensor(Param):
    """One HF tensor, held under its own name in the model's ``params``."""

    def export(self, model) -> dict[str, np.ndarray]:
        return {self.hf_name: np.asarray(jax.device_get(model.params[self.hf_name].array))}

    def load(self, skeleton, tensors: dict[str, np.ndarray]):
        like = skeleton.params[self.hf_name]
        array, want = self._take(tensors, self.hf_name), like.array.shape
        if tuple(array.shape) != tuple(want):
            raise BadFileError(f"HF tensor {self.hf_name} has shape {array.shape}; expected {want}")
        return hax.named(jnp.asarray(array, like.dtype), like.axes)


@dataclass(frozen=True)
class _Experts(Param):
    """Every expert's HF tensor (``{e}`` in ``hf_name``, ``[out, in]``), held stacked under
    ``key`` in the model's ``params`` in ``models/moe``'s ``[experts, in, out]`` layout."""

    key: str = ""

    def export(self, model) -> dict[str, np.ndarray]:
        stacked = np.asarray(jax.device_get(model.params[self.key].array))
        return {self.hf_name.format(e=e): w.T for e, w in enumerate(stacked)}

    def load(self, skeleton, tensors: dict[str, np.ndarray]):
        like = skeleton.params[self.key]
        names = [self.hf_name.format(e=e) for e in range(like.array.shape[0])]
        array = np.stack([self._take(tensors, n).T for n in names])
        if tuple(array.shape) != tuple(like.array.shape):
            raise BadFileError(
                f"HF tensors {self.hf_name} have shape {array.shape[1:]}; expected {like.array.shape[1:]}"
            )
        return hax.named(jnp.asarray(array, like.dtype), like.axes)


@LmConfig.register_subclass("qwen3_next")
@dataclass(frozen=True)
class Qwen3NextConfig(LmConfig):
    """Qwen3-Next: Gated DeltaNet and gated full-attention layers, experts with a shared expert."""

    seq_len: int = 4096
    """Tokens per training sequence (the `position` axis)."""
    hidden_dim: int = 2048
    """Width of the residual stream."""
    num_layers: int = 48
    """Number of layers (linear and full together)."""
    layer_types: tuple[str, ...] = ("linear_attention",) * 3 + ("full_attention",)
    """Each layer's kind, linear_attention (Gated DeltaNet) or full_attention, repeated over the layers."""
    num_heads: int = 16
    """Query heads of the full-attention layers."""
    num_kv_heads: int = 2
    """Key/value heads of the full-attention layers; must divide num_heads."""
    head_dim: int = 256
    """Size of each full-attention head."""
    partial_rotary_factor: float = 0.25
    """The share of each full-attention head that rotary rotates (its first dims)."""
    rope_theta: float = 10_000.0
    """Rotary base."""
    linear_key_heads: int = 16
    """Gated DeltaNet query/key heads."""
    linear_value_heads: int = 32
    """Gated DeltaNet value heads (a multiple of linear_key_heads)."""
    linear_key_dim: int = 128
    """Gated DeltaNet query/key head size."""
    linear_value_dim: int = 128
    """Gated DeltaNet value head size."""
    linear_conv_kernel: int = 4
    """Taps of the Gated DeltaNet's short causal convolutions."""
    linear_chunk: int = 64
    """Positions per chunk of the gated delta rule's chunked (WY) training form."""
    expert_dim: int = 512
    """Width of each routed expert's MLP (moe_intermediate_size)."""
    shared_expert_dim: int = 512
    """Width of the shared expert's MLP (shared_expert_intermediate_size)."""
    moe: MoeConfig = field(default_factory=_moe)
    """Experts and routing (num_experts, num_experts_per_tok, norm_topk_prob are read)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the LM head."""
    initializer_range: float = 0.02
    """Standard deviation of the initial embeddings."""

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        bad = [k for k in self.layer_types if k not in KINDS]
        if bad or not self.layer_types:
            raise ConfigError(f"model.layer_types: each must be one of {KINDS}, got {bad or '[]'}")
        if self.num_heads % self.num_kv_heads or self.linear_value_heads % self.linear_key_heads:
            raise ConfigError("model.num_kv_heads must divide model.num_heads and "
                              "model.linear_key_heads model.linear_value_heads")  # fmt: skip
        unsupported = {
            "fp8": self.fp8 != "off", "lora": self.lora is not None,
            "document_positions": bool(self.document_positions),
            "embed_pdrop": self.embed_pdrop > 0, "resid_pdrop": self.resid_pdrop > 0,
            "attn_pdrop": self.attn_pdrop > 0,
            "gradient_checkpointing": self.gradient_checkpointing == "nested",
        }  # fmt: skip
        for key, used in unsupported.items():
            if used:
                raise ConfigError(f"model.{key} is not supported by model.type qwen3_next")
        if self.rotary_dim % 2 or not 0 < self.partial_rotary_factor <= 1:
            raise ConfigError(f"model.partial_rotary_factor {self.partial_rotary_factor} must "
                              "rotate an even number of dims of head_dim")  # fmt: skip

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind: ``layer_types`` repeated to ``num_layers``."""
        n = len(self.layer_types)
        return tuple(self.layer_types[i % n] for i in range(self.num_layers))

    @property
    def has_experts(self) -> bool:
        """Each layer's MLP is the experts and the shared expert (dense Qwen3.5: False)."""
        return True

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def build(self, vocab_size: int, *, key) -> Qwen3NextLmModel:
        names = [(getattr(p, "key", "") or p.hf_name, s) for p, s in self._shapes(vocab_size)]
        keys = jax.random.split(key, len(names))
        params = {}
        for k, (name, shape) in zip(keys, names, strict=True):
            if name.endswith(("norm.weight", "layernorm.weight")) and "linear_attn" not in name:
                params[name] = jnp.zeros(shape)  # zero-centred: 1 + w
            elif name.endswith("linear_attn.norm.weight"):
                params[name] = jnp.ones(shape)
            elif name.endswith("dt_bias"):
                params[name] = jnp.ones(shape)
            elif name.endswith("A_log"):
                params[name] = jnp.log(jax.random.uniform(k, shape, minval=1, maxval=16))
            elif name.endswith("embed_tokens.weight"):
                params[name] = jax.random.normal(k, shape) * self.initializer_range
            else:
                fan = shape[-2] if ".experts." in name else math.prod(shape[1:])
                params[name] = jax.random.normal(k, shape) / math.sqrt(fan)
        named = {n: hax.named(a, _axes(n, a.shape, self.hidden_dim)) for n, a in params.items()}
        return Qwen3NextLmModel(self, named, vocab_size)

    def _shapes(self, vocab: int) -> list[tuple[Param, tuple[int, ...]]]:
        """Every HF tensor with its shape."""
        d, H, K, hd = self.hidden_dim, self.num_heads, self.num_kv_heads, self.head_dim
        hk, hv, dk, dv = (
            self.linear_key_heads,
            self.linear_value_heads,
            self.linear_key_dim,
            self.linear_value_dim,
        )
        E = self.moe.num_experts
        out = [("model.embed_tokens.weight", (vocab, d)), ("model.norm.weight", (d,))]
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (vocab, d)))
        for i, kind in enumerate(self.layer_kinds):
            p = f"model.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (d,)),
                (p + "post_attention_layernorm.weight", (d,)),
            ]
            if kind == "linear_attention":
                a = p + "linear_attn."
                out += [
                    (a + "in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, d)),
                    (a + "in_proj_ba.weight", (2 * hv, d)),
                    (a + "conv1d.weight", (2 * hk * dk + hv * dv, 1, self.linear_conv_kernel)),
                    (a + "dt_bias", (hv,)), (a + "A_log", (hv,)), (a + "norm.weight", (dv,)),
                    (a + "out_proj.weight", (d, hv * dv)),
                ]  # fmt: skip
            else:
                a = p + "self_attn."
                out += [
                    (a + "q_proj.weight", (2 * H * hd, d)), (a + "k_proj.weight", (K * hd, d)),
                    (a + "v_proj.weight", (K * hd, d)), (a + "o_proj.weight", (d, H * hd)),
                    (a + "q_norm.weight", (hd,)), (a + "k_norm.weight", (hd,)),
                ]  # fmt: skip
            m = p + "mlp."
            out += [(m + "gate.weight", (E, d)), (m + "shared_expert_gate.weight", (1, d))]
            w, ws = self.expert_dim, self.shared_expert_dim
            out += [(m + "experts.gate_proj", (E, d, w)), (m + "experts.up_proj", (E, d, w)),
                    (m + "experts.down_proj", (E, w, d)), (m + "shared_expert.gate_proj.weight", (ws, d)),
                    (m + "shared_expert.up_proj.weight", (ws, d)),
                    (m + "shared_expert.down_proj.weight", (d, ws))]  # fmt: skip
        return [(_param(n), s) for n, s in out]

    def flops_per_token(self, vocab_size: int, *, causal: bool = True) -> float:
        """Forward FLOPs of the active parameters (k experts and the shared one; the dense
        fallback computes all experts: not counted), attention scores by ``seq_len``."""
        d, per = self.hidden_dim, 0.0
        k = self.moe.num_experts_per_tok
        mlp = (
            2 * 3 * d * (k * self.expert_dim + self.shared_expert_dim)
            + 2 * d * self.moe.num_experts
        )
        for kind in self.layer_kinds:
            if kind == "linear_attention":
                hk, hv = self.linear_key_heads, self.linear_value_heads
                dk, dv = self.linear_key_dim, self.linear_value_dim
                per += 2 * d * (2 * hk * dk + 2 * hv * dv + 2 * hv) + 2 * hv * dv * d
                per += 2 * 4 * hv * dk * dv  # the state's update and read
            else:
                q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
                per += 2 * d * (3 * q + 2 * kv)
                per += (2 if causal else 4) * self.seq_len * q
            per += mlp
        return float(per + 2 * d * vocab_size)

    # Hugging Face ------------------------------------------------------------------------
    hf_model_type: ClassVar[str | None] = "qwen3_next"
    hf_architecture: ClassVar[str] = "Qwen3NextForCausalLM"
    hf_run_keys: ClassVar[tuple[str, ...]] = (
        "attention_dropout",
        "max_position_embeddings",
        "router_aux_loss_coef",
    )
    hf_field_names: ClassVar[dict[str, str | None]] = {
        "hidden_size": "hidden_dim", "num_hidden_layers": "num_layers", "layer_types": "layer_types",
        "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
        "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps",
        "linear_num_key_heads": "linear_key_heads", "linear_num_value_heads": "linear_value_heads",
        "linear_key_head_dim": "linear_key_dim", "linear_value_head_dim": "linear_value_dim",
        "linear_conv_kernel_dim": "linear_conv_kernel", "moe_intermediate_size": "expert_dim",
        "shared_expert_intermediate_size": "shared_expert_dim", "num_experts": "moe.num_experts",
        "num_experts_per_tok": "moe.num_experts_per_tok", "norm_topk_prob": "moe.norm_topk_prob",
        "tie_word_embeddings": "tie_word_embeddings", "initializer_range": "initializer_range",
        "max_position_embeddings": "seq_len", "intermediate_size": None, "hidden_act": None,
        "decoder_sparse_step": None, "mlp_only_layers": None, "output_router_logits": None,
        "attention_bias": None, "attention_dropout": None, "rope_parameters": None,
        "router_aux_loss_coef": None,
    }  # fmt: skip

    def hf_params(self) -> list[Param]:
        return [p for p, _ in self._shapes(1)]

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        names = {k: v for k, v in self.hf_field_names.items() if v and "." not in v}
        out = {k: getattr(self, v) for k, v in names.items()}
        return {
            "architectures": [self.hf_architecture], "model_type": self.hf_model_type,
            "vocab_size": vocab_size, **out, "layer_types": list(self.layer_kinds),
            "num_experts": self.moe.num_experts, "num_experts_per_tok": self.moe.num_experts_per_tok,
            "norm_topk_prob": self.moe.norm_topk_prob, "intermediate_size": self.expert_dim,
            "hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": [],
            "attention_bias": False, "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
        }  # fmt: skip

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Qwen3NextConfig:
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise BadFileError("config.json: dense layers (decoder_sparse_step > 1 or "
                               "mlp_only_layers) are not supported for qwen3_next")  # fmt: skip
        if hf.get("attention_bias"):
            raise BadFileError("config.json: attention_bias is not supported for qwen3_next")
        rope = dict(hf.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise BadFileError(
                f"config.json: rope_parameters {rope} (scaling) is not supported for qwen3_next"
            )
        fields = {v: hf[k] for k, v in cls.hf_field_names.items() if v and "." not in v and k in hf}
        n = hf.get("num_hidden_layers", 48)
        kinds = hf.get("layer_types") or [KINDS[(i + 1) % 4 == 0] for i in range(n)]
        moe = replace(_moe(), num_experts=hf.get("num_experts", 512),
                      num_experts_per_tok=hf.get("num_experts_per_tok", 10),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", True)))  # fmt: skip
        return cls(**{**fields, "layer_types": tuple(kinds)}, moe=moe,
                   rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10_000.0)),
                   partial_rotary_factor=rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))  # fmt: skip
