"""Hugging Face interop: safetensors + config.json export and import (GPT-2, Llama)."""

from loomax.hf.convert import (
    config_from_hf,
    export_hf,
    hf_state,
    load_hf,
    read_hf,
    special_token_ids,
)

__all__ = ["config_from_hf", "export_hf", "hf_state", "load_hf", "read_hf", "special_token_ids"]
