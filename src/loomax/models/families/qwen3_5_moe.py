"""Qwen3.5-MoE's text model (``Qwen3_5MoeForCausalLM``, ``model_type`` ``qwen3_5_moe_text``):
Qwen3-Next's hybrid stack (``qwen3_next.py``, the same model) in another checkpoint layout.

The Gated DeltaNet's input projections are four HF tensors, ``linear_attn.in_proj_qkv``
(queries, keys, values, each head after head), ``in_proj_z``, ``in_proj_b`` and
``in_proj_a``, where Qwen3-Next fuses them into two interleaved per key-head group
(``in_proj_qkvz``, ``in_proj_ba``); the model keeps Qwen3-Next's fused layout and import and
export regroup the rows. The router always renormalises its top k (no ``norm_topk_prob``).
Its rotary is Qwen3-VL's interleaved multimodal RoPE, which for text (the three position
streams equal) is Qwen3-Next's partial rotary; ``rope_parameters``' ``mrope_section`` and
``mrope_interleaved`` are read past.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.models.config import LmConfig
from loomax.models.families.qwen3_next import Qwen3NextConfig
from loomax.models.io.hf_layout import Param

_SPLIT = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}


@dataclass(frozen=True)
class _Regrouped(Param):
    """One of Qwen3.5's separate tensors (``hf_name``, ``names[index]``) that together are
    Qwen3-Next's fused ``key`` (``[key heads x sum(parts), D]``, each key-head group's rows
    in turn). Each HF tensor is ``split[j]`` of a group's ``parts`` concatenated over the
    groups, part after part. Export writes this tensor; load rebuilds the whole fused one
    from every name (each of its Params gives the same)."""

    key: str = ""
    names: tuple[str, ...] = ()
    index: int = 0
    groups: int = 1
    parts: tuple[int, ...] = ()
    split: tuple[int, ...] = ()

    def export(self, model) -> dict[str, np.ndarray]:
        fused = np.asarray(jax.device_get(model.params[self.key].array))
        grouped = fused.reshape(self.groups, sum(self.parts), -1)
        pieces = np.split(grouped, np.cumsum(self.parts)[:-1], axis=1)
        first = sum(self.split[: self.index])
        mine = pieces[first : first + self.split[self.index]]
        return {self.hf_name: np.concatenate([p.reshape(-1, fused.shape[-1]) for p in mine])}

    def load(self, skeleton, tensors: dict[str, np.ndarray]):
        like = skeleton.params[self.key]
        width, rows, pieces = like.array.shape[-1], iter(self.parts), []
        for name, count in zip(self.names, self.split, strict=True):
            array = self._take(tensors, name)
            sizes = [next(rows) for _ in range(count)]
            if array.shape != (self.groups * sum(sizes), width):
                raise BadFileError(f"HF tensor {name} has shape {array.shape}; expected "
                                   f"{(self.groups * sum(sizes), width)}")  # fmt: skip
            cuts = np.cumsum([self.groups * s for s in sizes])[:-1]
            pieces += [p.reshape(self.groups, -1, width) for p in np.split(array, cuts)]
        fused = np.concatenate(pieces, axis=1).reshape(like.array.shape)
        return hax.named(jnp.asarray(fused, like.dtype), like.axes)


@LmConfig.register_subclass("qwen3_5_moe_text")
@dataclass(frozen=True)
class Qwen35MoeConfig(Qwen3NextConfig):
    """Qwen3.5-MoE (text): Qwen3-Next's model with the DeltaNet's projections as four HF tensors."""

    def __post_init__(self):
        super().__post_init__()
        if not self.moe.norm_topk_prob:
            raise ConfigError("model.moe.norm_topk_prob must be true for model.type "
                              "qwen3_5_moe_text (its router always renormalises the top k)")  # fmt: skip

    def hf_params(self) -> list[Param]:
        """Qwen3-Next's, with each fused DeltaNet projection as its separate HF tensors."""
        hk, r = self.linear_key_heads, self.linear_value_heads // self.linear_key_heads
        dk, dv = self.linear_key_dim, self.linear_value_dim
        parts = {"in_proj_qkvz": ((dk, dk, r * dv, r * dv), (3, 1)), "in_proj_ba": ((r, r), (1, 1))}
        out = []
        for p in super().hf_params():
            stem, _, leaf = p.hf_name.rpartition(".linear_attn.")
            fused = leaf.removesuffix(".weight")
            if fused not in _SPLIT:
                out.append(p)
                continue
            names = tuple(f"{stem}.linear_attn.{n}.weight" for n in _SPLIT[fused])
            sizes, split = parts[fused]
            out += [
                _Regrouped(name, p.where, (), key=p.hf_name, names=names, index=j, groups=hk,
                           parts=sizes, split=split)
                for j, name in enumerate(names)
            ]  # fmt: skip
        return out

    hf_model_type: ClassVar[str | None] = "qwen3_5_moe_text"
    hf_architecture: ClassVar[str] = "Qwen3_5MoeForCausalLM"
    hf_field_names: ClassVar[dict[str, str | None]] = {
        k: v for k, v in Qwen3NextConfig.hf_field_names.items()
        if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "intermediate_size")
    }  # fmt: skip

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        out = super().hf_config(vocab_size)
        for key in (
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "intermediate_size",
        ):
            out.pop(key)
        return out | {"architectures": [self.hf_architecture], "model_type": self.hf_model_type}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Qwen35MoeConfig:
        return super().from_hf_config({**hf, "norm_topk_prob": True})
