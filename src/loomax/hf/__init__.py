"""Hugging Face interop: safetensors + config.json export and import (GPT-2, Llama, Mixtral)."""

from loomax.hf.convert import (
    check_hf,
    config_from_hf,
    export_hf,
    hf_state,
    load_hf,
    read_hf,
    special_token_ids,
)

__all__ = [
    "check_hf",
    "config_from_hf",
    "export_hf",
    "hf_state",
    "load_hf",
    "read_hf",
    "special_token_ids",
]
