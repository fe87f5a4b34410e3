"""Phi-3 (``Phi3ForCausalLM``): Llama whose query, key and value projections are one fused HF
tensor (``qkv_proj``), as are the gate and up projections (``gate_up_proj``); no biases.

Only full rotary dimensions (``partial_rotary_factor`` 1) and plain rope types are read, and
only the default rope is written (transformers' Phi-3 refuses other scalings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.models.attention.rotary import DefaultRotary
from loomax.models.config import LmConfig
from loomax.models.families.llama import LlamaConfig
from loomax.models.io.hf_layout import Param


@LmConfig.register_subclass("phi3")
@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    """Phi-3 (Abdin et al. 2024): Llama with fused projections in its checkpoints."""

    hf_model_type: ClassVar[str | None] = "phi3"
    hf_architecture: ClassVar[str] = "Phi3ForCausalLM"
    hf_run_keys: ClassVar[tuple[str, ...]] = (
        *LlamaConfig.hf_run_keys,
        "resid_pdrop",
        "embd_pdrop",
    )
    hf_field_names: ClassVar[dict[str, str | None]] = {
        **LlamaConfig.hf_field_names,
        "resid_pdrop": "resid_pdrop", "embd_pdrop": "embed_pdrop", "pad_token_id": None,
    }  # fmt: skip
    hf_requires: ClassVar[dict[str, tuple[Any, str]]] = {
        **LlamaConfig.hf_requires,
        "use_bias": (False, "has no biases"),
    }

    def hf_params(self) -> list[Param]:
        fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
        fused |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
        q, kv, m = (
            self.num_heads * self.head_size,
            self.kv_heads * self.head_size,
            self.intermediate_dim,
        )
        rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        rows |= {"gate_proj": (0, m), "up_proj": (m, 2 * m)}
        out = []
        for p in super().hf_params():
            part = p.hf_name.rsplit(".", 2)[-2]
            if part in fused:
                name = p.hf_name.replace(part, fused[part])
                p = Param(name, p.where, p.dims, rows=rows[part])
            out.append(p)
        return out

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        if self.head_size * self.num_heads != self.hidden_dim:
            raise ConfigError(
                "Phi3ForCausalLM has heads of hidden_dim / num_heads: export needs model.head_dim: null"
            )
        if type(self.rope) is not DefaultRotary:  # transformers' Phi-3 scales by longrope only
            raise ConfigError(
                "Phi3ForCausalLM has no such rope scaling: export needs model.rope.type: default"
            )
        out = super().hf_config(vocab_size)
        del out["attention_bias"], out["mlp_bias"], out["head_dim"]
        out |= {
            "pad_token_id": None,
            "resid_pdrop": self.resid_pdrop,
            "embd_pdrop": self.embed_pdrop,
        }
        return out

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Phi3Config:
        rope = dict(hf.get("rope_parameters") or {})
        if rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
            raise BadFileError("config.json: partial_rotary_factor other than 1 is not supported")
        fields = cls._hf_fields({**hf, "rope_parameters": rope})
        fields |= dict(
            resid_pdrop=hf.get("resid_pdrop", 0.0), embed_pdrop=hf.get("embd_pdrop", 0.0)
        )
        return cls(**fields)
