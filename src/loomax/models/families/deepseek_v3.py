"""DeepSeek-V3: multi-head latent attention, DeepSeek routing, dense first layers (DeepSeek-AI 2024).

``model.type: deepseek_v3`` is the Mixtral model's layout with every block's attention
``models.attention.mla.MlaAttention`` (low-rank query, one compressed key/value latent, a
shared rotary key; decoding caches the latent only), its MoE MLP routed as DeepSeek-V3 (sigmoid
scores, the bias for the choice only, group-limited top-k, ``routed_scaling_factor``, one
shared expert), dense first ``moe.first_dense_layers``; router statistics, balance losses
and the bias update are ``MixtralLmModel``'s; the defaults are the 671B model's.

Its HF side (``DeepseekV3ForCausalLM``, transformers >= 4.57): per layer
``self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj}``, the dense layers' ``mlp.{gate,up,down}_proj``, the
routed layers' ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias`` (the routing
bias), each expert's ``mlp.experts.E.{gate,up,down}_proj.weight`` (Hub layout) and
``mlp.shared_experts.*``. ``num_key_value_heads`` is written as ``num_heads`` (MLA has no
grouped heads); ``num_nextn_predict_layers`` as 0: multi-token prediction modules are not
exported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
from haliax import Axis, NamedArray
from jaxtyping import PRNGKeyArray

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.models.attention.mla import MlaConfig, _deepseek_v3_rope
from loomax.models.attention.mla_cache import MlaCache
from loomax.models.attention.rotary import RotaryConfig
from loomax.models.axes import Vocab
from loomax.models.blocks import taps
from loomax.models.blocks.mla_block import MlaDenseBlock, MlaMoeBlock
from loomax.models.blocks.mtp import MTP_LOAD, MultiTokenPrediction, moe_runner, with_mtp_losses
from loomax.models.config import AuxOutputs, LmConfig
from loomax.models.families.llama import LlamaConfig
from loomax.models.families.mixtral import MixtralConfig, MixtralLmModel
from loomax.models.io.hf_layout import Param
from loomax.models.moe.moe import MoeConfig


def _deepseek_v3_moe() -> MoeConfig:
    return MoeConfig(
        num_experts=256, num_experts_per_tok=8, expert_intermediate_dim=2048,
        score_function="sigmoid", norm_topk_prob=True, num_shared_experts=1, num_groups=8,
        topk_groups=4, routed_scaling_factor=2.5, routing_bias=True, bias_update_rate=0.001,
        first_dense_layers=3, load_balance_loss_weight=0.0001, router_z_loss_weight=0.0,
    )  # fmt: skip


@LmConfig.register_subclass("deepseek_v3")
@dataclass(frozen=True)
class DeepseekV3Config(MixtralConfig):
    """DeepSeek-V3 decoder: multi-head latent attention and DeepSeek-routed experts."""

    seq_len: int = 4096
    """Tokens per training sequence (the `position` axis)."""
    hidden_dim: int = 7168
    """Width of the residual stream (the `embed` axis)."""
    intermediate_dim: int = 18432
    """Width of the dense first layers' gated MLP (the experts' width: moe.expert_intermediate_dim)."""
    num_layers: int = 61
    """Number of transformer blocks, dense first layers included."""
    num_heads: int = 128
    """Attention heads."""
    num_kv_heads: int | None = None
    """Not read: MLA's heads share one latent (config.json's num_key_value_heads is num_heads)."""
    head_dim: int | None = None
    """Not read: MLA's head sizes are qk_nope_head_dim, qk_rope_head_dim and v_head_dim."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope: RotaryConfig = field(default_factory=_deepseek_v3_rope)
    """Rotary embeddings of the qk_rope dims (DeepSeek-V3: YaRN, factor 40, mscale_all_dim 1)."""
    q_lora_rank: int | None = 1536
    """Rank of the query bottleneck; null = one full q_proj."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (what decoding caches)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without rotary positions."""
    qk_rope_head_dim: int = 64
    """Per-head query dims with rotary positions (one rotary key shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value dims."""
    rope_interleave: bool = True
    """Rotary pairs are adjacent dims (DeepSeek's checkpoints) rather than the two halves."""
    attention_bias: bool = False
    """Biases on q_a_proj, kv_a_proj and o_proj."""
    mtp_depth: int = 0
    """Multi-token prediction modules (DeepSeek-V3: 1), depth d predicting the token d + 1 ahead; trained, logged as mtp/loss_<d>, left out of train/loss and of HF export; 0 = none."""
    mtp_loss_weights: tuple[float, ...] = ()
    """Each depth's weight in the training objective; empty = 0.3 / mtp_depth each (DeepSeek-V3's lambda / D)."""
    moe: MoeConfig = field(default_factory=_deepseek_v3_moe)
    """Experts and DeepSeek routing (the `moe` section; V3: 256 experts of 2048, top 8 within 4 of 8 groups, sigmoid, bias, scale 2.5, one shared expert, 3 dense first layers)."""

    def __post_init__(self):
        super().__post_init__()
        unsupported = (
            ("qk_norm", "QK-norm"), ("use_bias", "biases in the MLPs"),
            ("input_embedding_norm", "a norm on the embeddings"),
        )  # fmt: skip
        for key, what in unsupported:
            if getattr(self, key):
                raise ConfigError(
                    f"model.{key} ({what}) is not supported by model.type deepseek_v3"
                )
        if self.sliding_window is not None:
            raise ConfigError("model.sliding_window is not supported by model.type deepseek_v3")
        self.mla  # noqa: B018  (checks the attention's sizes)
        object.__setattr__(self, "mtp_loss_weights", tuple(self.mtp_loss_weights))
        weights = self.mtp_loss_weights
        if self.mtp_depth < 0 or (weights and len(weights) != self.mtp_depth) or min(weights, default=0) < 0:  # fmt: skip
            raise ConfigError(
                f"model.mtp_depth ({self.mtp_depth}) must be >= 0 and model.mtp_loss_weights "
                f"({list(weights)}) empty or one weight >= 0 per depth"
            )

    @property
    def mtp_weights(self) -> tuple[float, ...]:
        """Each multi-token prediction depth's loss weight."""
        return self.mtp_loss_weights or (0.3 / max(self.mtp_depth, 1),) * self.mtp_depth

    @property
    def mla(self) -> MlaConfig:
        """The attention's shapes."""
        return MlaConfig(
            hidden_dim=self.hidden_dim, num_heads=self.num_heads, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, rope=self.rope,
            rope_interleave=self.rope_interleave, norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
        )  # fmt: skip

    def build(self, vocab_size: int, *, key: PRNGKeyArray) -> DeepseekV3LmModel:
        return DeepseekV3LmModel.init(self, Axis(Vocab, vocab_size), key=key)

    def flops_per_token(self, vocab_size: int, *, causal: bool = True) -> float:
        """Forward FLOPs of the active parameters (MLA's projections, k routed and the shared
        experts, the router) and of QK^T and PV over the padded-free head dims."""
        d, h, moe = self.hidden_dim, self.num_heads, self.moe
        qk, nope, v = self.mla.qk_head_dim, self.qk_nope_head_dim, self.v_head_dim
        q = d * h * qk if self.q_lora_rank is None else self.q_lora_rank * (d + h * qk)
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (nope + v)
        attn = 2 * (q + kv + h * v * d)
        routed = 2 * 3 * d * self.expert_dim * (moe.num_experts_per_tok + moe.num_shared_experts)
        routed += 2 * d * moe.num_experts
        dense, s = moe.first_dense_layers, self.seq_len
        keys = (s + 1) / 2 if causal else s
        scores = 2 * keys * h * (qk + v)
        layers = (self.num_layers - dense) * routed + dense * 2 * 3 * d * self.intermediate_dim
        mtp = self.mtp_depth * (attn + scores + routed + 2 * 2 * d * d + 2 * d * vocab_size)
        return float(self.num_layers * (attn + scores) + layers + 2 * d * vocab_size + mtp)

    # Hugging Face (loomax.hf.family.HfFamily) ---------------------------------------------
    hf_model_type: ClassVar[str | None] = "deepseek_v3"
    hf_architecture: ClassVar[str] = "DeepseekV3ForCausalLM"
    hf_run_keys: ClassVar[tuple[str, ...]] = LlamaConfig.hf_run_keys
    """config.json fields a run may change: dropout, the context length."""
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **{k: v for k, v in LlamaConfig.hf_field_names.items() if k != "mlp_bias"},
        "attention_bias": "attention_bias", "num_key_value_heads": None, "head_dim": None,
        "moe_intermediate_size": "moe.expert_intermediate_dim",
        "n_routed_experts": "moe.num_experts", "num_experts_per_tok": "moe.num_experts_per_tok",
        "n_shared_experts": "moe.num_shared_experts", "n_group": "moe.num_groups",
        "topk_group": "moe.topk_groups", "routed_scaling_factor": "moe.routed_scaling_factor",
        "norm_topk_prob": "moe.norm_topk_prob", "first_k_dense_replace": "moe.first_dense_layers",
        "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
        "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
        "v_head_dim": "v_head_dim", "rope_interleave": "rope_interleave", "qk_head_dim": None,
        "num_nextn_predict_layers": None, "output_router_logits": None, "pretraining_tp": None,
    }  # fmt: skip
    hf_moe_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        "score_function": ("sigmoid", "routes by sigmoid scores"),
        "capacity_factor": (None, "drops no tokens"),
    }

    def hf_params(self) -> list[Param]:
        """The embeddings, norms and head; each layer's attention and norms, the dense
        layers' MLP and the routed layers' router, routing bias, experts and shared expert."""
        out = [
            Param("model.embed_tokens.weight", lambda m: m.embed_tokens.weight, ("vocab", "embed")),
            Param("model.norm.weight", lambda m: m.norm.weight, ("embed",)),
        ]  # fmt: skip
        if not self.tie_word_embeddings:
            out.append(Param("lm_head.weight", lambda m: m.lm_head.weight, ("vocab", "embed")))
        n = self.moe.first_dense_layers
        dense, routed = (lambda m: m.dense_blocks.stacked), (lambda m: m.blocks.stacked)
        if n:
            out += self._hf_block(dense, 0)
            for name in ("gate_proj", "up_proj", "down_proj"):
                dims = ("embed", "mlp") if name == "down_proj" else ("mlp", "embed")
                where = lambda m, name=name: getattr(dense(m).mlp, name).weight  # noqa: E731
                out.append(Param(f"model.layers.{{i}}.mlp.{name}.weight", where, dims))
        out += self._hf_block(routed, n)
        mlp = "model.layers.{i}.mlp."
        experts = (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
        shared = (("gate_proj", "shared_gate"), ("up_proj", "shared_up"), ("down_proj", "shared_down"))  # fmt: skip
        out += [
            Param(
                mlp + "gate.weight",
                lambda m: routed(m).mlp.router.weight,
                ("experts", "embed"),
                first_layer=n,
            ),  # fmt: skip
            Param(
                mlp + "gate.e_score_correction_bias",
                lambda m: routed(m).mlp.bias.value,
                ("experts",),
                first_layer=n,
            ),  # fmt: skip
        ]
        for hf, ours in experts:
            dims = ("embed", "mlp") if hf == "down_proj" else ("mlp", "embed")
            where = lambda m, ours=ours: getattr(routed(m).mlp, ours)  # noqa: E731
            out.append(Param(f"{mlp}experts.{{e}}.{hf}.weight", where, dims, first_layer=n))
        for hf, ours in shared:
            dims = ("embed", "mlp") if hf == "down_proj" else ("mlp", "embed")
            where = lambda m, ours=ours: getattr(routed(m).mlp, ours).weight  # noqa: E731
            out.append(Param(f"{mlp}shared_experts.{hf}.weight", where, dims, first_layer=n))
        return out

    def _hf_block(self, stack, first: int) -> list[Param]:
        """One stack's norms and attention tensors, its first block HF's layer ``first``."""
        blk = "model.layers.{i}."
        at = blk + "self_attn."
        a = lambda m: stack(m).attn  # noqa: E731
        qk = ("heads", "head_size")
        specs = [
            (blk + "input_layernorm.weight", lambda m: stack(m).input_norm.weight, ("embed",)),
            (
                blk + "post_attention_layernorm.weight",
                lambda m: stack(m).post_attn_norm.weight,
                ("embed",),
            ),  # fmt: skip
            (at + "kv_a_proj_with_mqa.weight", lambda m: a(m).kv_a_proj.weight, ("kv_a", "embed")),
            (at + "kv_a_layernorm.weight", lambda m: a(m).kv_a_norm.weight, ("kv_lora",)),
            (
                at + "kv_b_proj.weight",
                lambda m: a(m).kv_b_proj.weight,
                (("heads", "kv_b"), "kv_lora"),
            ),  # fmt: skip
            (at + "o_proj.weight", lambda m: a(m).o_proj.weight, ("embed", ("heads", "v_head"))),
        ]
        if self.q_lora_rank is None:
            specs.append((at + "q_proj.weight", lambda m: a(m).q_proj.weight, (qk, "embed")))
        else:
            specs += [
                (at + "q_a_proj.weight", lambda m: a(m).q_a_proj.weight, ("q_lora", "embed")),
                (at + "q_a_layernorm.weight", lambda m: a(m).q_a_norm.weight, ("q_lora",)),
                (at + "q_b_proj.weight", lambda m: a(m).q_b_proj.weight, (qk, "q_lora")),
            ]
        if self.attention_bias:
            specs += [
                (at + "kv_a_proj_with_mqa.bias", lambda m: a(m).kv_a_proj.bias, ("kv_a",)),
                (at + "o_proj.bias", lambda m: a(m).o_proj.bias, ("embed",)),
            ]
            if self.q_lora_rank is not None:
                specs.append((at + "q_a_proj.bias", lambda m: a(m).q_a_proj.bias, ("q_lora",)))
        return [Param(name, where, dims, first_layer=first) for name, where, dims in specs]

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        moe = self.moe
        for key, (want, what) in self.hf_moe_requires.items():
            if getattr(moe, key) != want:
                raise ConfigError(f"{self.hf_architecture} {what}: export needs model.moe.{key}: {want}")  # fmt: skip
        if not moe.has_bias or moe.num_shared_experts < 1:
            raise ConfigError(
                f"{self.hf_architecture} has a routing bias and shared experts: export needs "
                "model.moe.routing_bias: true (or bias_update_rate > 0) and num_shared_experts >= 1"
            )
        out = LlamaConfig.hf_config(self, vocab_size)
        del out["head_dim"], out["mlp_bias"]
        return {
            **out,
            "num_key_value_heads": self.num_heads,
            "attention_bias": self.attention_bias,
            "moe_intermediate_size": self.expert_dim,
            "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "n_shared_experts": moe.num_shared_experts,
            "n_group": moe.num_groups,
            "topk_group": moe.topk_groups,
            "routed_scaling_factor": moe.routed_scaling_factor,
            "norm_topk_prob": moe.norm_topk_prob,
            "first_k_dense_replace": moe.first_dense_layers,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_interleave": self.rope_interleave,
            "num_nextn_predict_layers": 0,
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> DeepseekV3Config:
        if hf.get("mlp_bias"):
            raise BadFileError("config.json: mlp_bias is not supported by model.type deepseek_v3")
        d = cls()
        heads = hf["num_attention_heads"]
        fields = cls._hf_fields({**hf, "num_key_value_heads": heads, "head_dim": None})
        del fields["num_kv_heads"], fields["head_dim"]
        groups = hf.get("n_group") or 1
        moe = MoeConfig(
            num_experts=hf.get("n_routed_experts", d.moe.num_experts),
            num_experts_per_tok=hf.get("num_experts_per_tok", d.moe.num_experts_per_tok),
            expert_intermediate_dim=hf.get("moe_intermediate_size", d.moe.expert_intermediate_dim),
            score_function="sigmoid",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            num_shared_experts=hf.get("n_shared_experts", 1),
            num_groups=groups,
            topk_groups=hf.get("topk_group") or groups,
            routed_scaling_factor=hf.get("routed_scaling_factor", 2.5),
            routing_bias=True,
            bias_update_rate=d.moe.bias_update_rate,
            first_dense_layers=hf.get("first_k_dense_replace", 3) or 0,
            load_balance_loss_weight=d.moe.load_balance_loss_weight,
            router_z_loss_weight=d.moe.router_z_loss_weight,
        )
        mla = {k: hf[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if k in hf}  # fmt: skip
        return cls(
            moe=moe, q_lora_rank=hf.get("q_lora_rank"), rope_interleave=hf.get("rope_interleave", True),
            attention_bias=bool(hf.get("attention_bias", False)), **mla, **fields,
        )  # fmt: skip


class DeepseekV3LmModel(MixtralLmModel):
    """The Mixtral model's embedding, stacks, router statistics and head around DeepSeek-V3's
    blocks; decoding caches MLA's latent and rotary key per layer (``MlaCache``)."""

    config: DeepseekV3Config = eqx.field(static=True)
    blocks: hnn.Stacked[MlaMoeBlock]
    dense_blocks: hnn.Stacked[MlaDenseBlock] | None = None
    mtp: MultiTokenPrediction | None = None  # mtp_depth

    @staticmethod
    def init(config: DeepseekV3Config, Vocab: Axis, *, key: PRNGKeyArray) -> DeepseekV3LmModel:
        k_tok, k_blocks, k_head = jax.random.split(key, 3)
        c, n = config, config.moe.first_dense_layers
        embed = hnn.Embedding(
            hax.random.normal(k_tok, (Vocab, c.Embed)) * c.initializer_range, Vocab, c.Embed
        )
        keys, remat = jax.random.split(k_blocks, c.num_layers), c.remat_policy
        blocks = hnn.Stacked.init(c.MoeLayers, MlaMoeBlock, gradient_checkpointing=remat)(
            c, key=keys[n:]
        )
        dense = None
        if n:
            dense = hnn.Stacked.init(
                Axis(c.Layers.name, n), MlaDenseBlock, gradient_checkpointing=remat
            )(c, key=keys[:n])
        head = None
        if not c.tie_word_embeddings:
            head = hnn.Linear.init(c.Embed, Vocab, key=k_head, use_bias=False)
        norm, mtp = c.make_norm(c.Embed), None
        if c.mtp_depth:
            block = lambda k: MlaMoeBlock.init(c, key=k)  # noqa: E731
            mtp_key = jax.random.fold_in(k_head, 1)
            mtp = MultiTokenPrediction.init(c.mtp_depth, c.Embed, c.rms_norm_eps, block, key=mtp_key)  # fmt: skip
        return DeepseekV3LmModel(c, embed, blocks, norm, head, None, dense, mtp)

    def hidden_states(self, tokens, *, segment_ids=None, key=None) -> NamedArray:
        x, _ = self.residual_and_aux(tokens, segment_ids=segment_ids, key=key)
        return taps.tap("final", self.norm(x))

    def hidden_states_and_aux(
        self, tokens, *, segment_ids=None, key=None
    ) -> tuple[NamedArray, AuxOutputs]:
        """The Mixtral model's, with the multi-token prediction losses (``mtp_depth``) as
        side losses (trained, not in the loss's value) and ``mtp/loss_<d>`` metrics."""
        x, aux = self.residual_and_aux(tokens, segment_ids=segment_ids, key=key)
        if self.mtp is not None:  # each depth's expert load moves its routing bias
            run_block, loads = moe_runner(self.config.moe.num_experts, segment_ids)
            head, embed = self.lm_head_weight(), self.embed_tokens.embed
            losses = self.mtp.losses(x, tokens, embed, head, run_block, segment_ids)
            aux = with_mtp_losses(aux, losses, self.config.mtp_weights, loads)
        return taps.tap("final", self.norm(x)), aux

    def update_state(self, stats: dict[str, jax.Array]) -> DeepseekV3LmModel:
        """The Mixtral model's routing bias update, and the MTP depths' (``MTP_LOAD``)."""
        model, rate = super().update_state(stats), self.config.moe.bias_update_rate
        if self.mtp is None or not rate or MTP_LOAD not in stats:
            return model
        return eqx.tree_at(lambda m: m.mtp, model, model.mtp.with_bias_moved(stats[MTP_LOAD], rate))

    def qk_clip_attention(self) -> dict[str, Any]:  # the Mixtral model's and each MTP depth's
        return {**super().qk_clip_attention(), **(self.mtp.qk_clip_attention(lambda m: m.mtp) if self.mtp is not None else {})}  # fmt: skip

    def init_cache(self, batch_axes, max_len: int, dtype) -> MlaCache:
        """The latent and rotary key of every layer, ``max_len`` positions."""
        return self.config.mla.init_cache(batch_axes, max_len, dtype, layers=self.config.Layers)
