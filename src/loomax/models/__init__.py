"""Language models on named axes; ``model.type`` picks one from the registry."""

from loomax.models.config import LmConfig, LmModel
from loomax.models.gpt2 import Gpt2Config, Gpt2LmModel
from loomax.models.loss import next_token_loss

__all__ = ["Gpt2Config", "Gpt2LmModel", "LmConfig", "LmModel", "next_token_loss"]
