"""Language models on named axes; ``model.type`` picks one from the registry."""

from loomax.models import families  # noqa: F401  (registers every family)
from loomax.models.attention.rotary import RotaryConfig
from loomax.models.config import KvCache, LmConfig, LmModel
from loomax.models.families.gpt2 import Gpt2Config, Gpt2LmModel
from loomax.models.families.llama import LlamaConfig, LlamaLmModel
from loomax.models.families.mixtral import MixtralConfig, MixtralLmModel
from loomax.models.families.olmoe import OlmoeConfig
from loomax.models.families.qwen3_moe import Qwen3MoeConfig
from loomax.models.loss import next_token_loss
from loomax.models.moe.moe import MoeConfig

__all__ = [
    "Gpt2Config",
    "Gpt2LmModel",
    "KvCache",
    "LlamaConfig",
    "LlamaLmModel",
    "LmConfig",
    "LmModel",
    "MixtralConfig",
    "MixtralLmModel",
    "MoeConfig",
    "OlmoeConfig",
    "Qwen3MoeConfig",
    "RotaryConfig",
    "next_token_loss",
]
