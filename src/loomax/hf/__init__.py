"""Hugging Face interop: safetensors + config.json export and import, for every model family
that defines its HF side (``loomax.hf.family.HfFamily``)."""

from loomax.hf.convert import (
    check_hf,
    config_from_hf,
    export_hf,
    hf_model_config,
    hf_state,
    load_hf,
    read_hf,
    special_token_ids,
)
from loomax.hf.family import HfFamily, families

__all__ = [
    "HfFamily",
    "families",
    "check_hf",
    "config_from_hf",
    "export_hf",
    "hf_model_config",
    "hf_state",
    "load_hf",
    "read_hf",
    "special_token_ids",
]
