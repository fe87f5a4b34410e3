"""Language models on named axes; ``model.type`` picks one from the registry."""

from loomax.models import families  # noqa: F401  (registers the families built on Llama)
from loomax.models.config import KvCache, LmConfig, LmModel
from loomax.models.gpt2 import Gpt2Config, Gpt2LmModel
from loomax.models.llama import LlamaConfig, LlamaLmModel
from loomax.models.loss import next_token_loss
from loomax.models.mixtral import MixtralConfig, MixtralLmModel
from loomax.models.moe import MoeConfig
from loomax.models.olmoe import OlmoeConfig
from loomax.models.qwen3_moe import Qwen3MoeConfig
from loomax.models.rotary import RotaryConfig

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
