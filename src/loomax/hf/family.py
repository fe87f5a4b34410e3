"""What a model family provides for Hugging Face interop, and finding the family of a config.

A family is one ``LmConfig`` subclass, registered once with ``@LmConfig.register_subclass``;
it takes part in HF export and import by defining ``hf_model_type`` and the rest of
``HfFamily`` on the config class itself. Nothing here lists families: ``families()`` reads
the config registry.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.models.config import LmConfig
from loomax.models.io.hf_layout import Param


@runtime_checkable
class HfFamily(Protocol):
    """The Hugging Face side of a model config (a ``transformers`` ``*ForCausalLM`` class)."""

    hf_model_type: ClassVar[str]
    """config.json's ``model_type`` (``AutoModelForCausalLM`` picks the class by it)."""
    hf_architecture: ClassVar[str]
    """The transformers class, written to config.json's ``architectures``."""
    hf_run_keys: ClassVar[tuple[str, ...]]
    """config.json fields that a run may set its own way when importing (dropout rates)."""
    hf_field_names: ClassVar[dict[str, str | None]]
    """Each config.json field and the model key it is (None: not read), ``hf.config_json``."""

    def hf_params(self) -> list[Param]:
        """Where each HF tensor lives in the model built from this config."""

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        """config.json of this config with ``vocab_size`` entries (``ConfigError`` naming a key
        the HF class cannot express)."""

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> LmConfig:
        """The config of a config.json dict (``BadFileError`` naming a field it cannot take)."""


_MEMBERS = (
    "hf_architecture",
    "hf_run_keys",
    "hf_field_names",
    "hf_params",
    "hf_config",
    "from_hf_config",
)


def families() -> dict[str, type[LmConfig]]:
    """``{model_type: config class}`` of every registered config that defines its own
    ``hf_model_type`` (a subclass that inherits one is not another family)."""
    out: dict[str, type[LmConfig]] = {}
    for cls in LmConfig.get_known_choices().values():
        kind = cls.__dict__.get("hf_model_type")
        if kind is not None and all(hasattr(cls, name) for name in _MEMBERS):
            out[kind] = cls
    return out


def family_of(config: LmConfig) -> HfFamily:
    """``config`` as an ``HfFamily``, or ``ConfigError`` if its family has no HF export."""
    if type(config).__dict__.get("hf_model_type") is None or not isinstance(config, HfFamily):
        raise ConfigError(f"no Hugging Face export for model type {type(config).__name__}")
    return config


HF_ALIASES = {"kimi_k2": "deepseek_v3"}
"""config.json model types that are another family's architecture at other sizes (Kimi K2's
checkpoints say ``kimi_k2``; transformers reads them as ``DeepseekV3Config``)."""


def family_for(hf: dict[str, Any]) -> type[LmConfig]:
    """The config class of a config.json dict, by its ``model_type`` (or ``HF_ALIASES``'s)."""
    kind = HF_ALIASES.get(hf.get("model_type"), hf.get("model_type"))
    known = families()
    if kind not in known:
        raise BadFileError(
            f"config.json: model_type {kind!r} is not supported (have {sorted(known)})"
        )
    return known[kind]
