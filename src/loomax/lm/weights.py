"""Where a run's first weights come from: a fresh init, or a Hugging Face checkpoint."""

from __future__ import annotations

import logging

from loomax.config import ConfigError
from loomax.errors import UserError
from loomax.lm.config import TrainLmConfig

logger = logging.getLogger(__name__)


def initial_model(config: TrainLmConfig, vocab_size: int):
    """``init(key) -> model``: the fresh weights of ``config.model``."""
    return lambda key: config.model.for_training(config.model.build(vocab_size, key=key))


def check_initial_weights(config: TrainLmConfig) -> None:
    """Fail before any expensive work if ``trainer.initialize_from_hf`` cannot be loaded
    (no such checkpoint, missing weight files, another architecture); reads no weights."""
    path = config.trainer.initialize_from_hf
    if path is None:
        return
    from loomax.hf import check_hf

    try:
        check_hf(path, config.model)
    except UserError as e:  # the file, the flag or key that named it
        raise type(e)(f"trainer.initialize_from_hf: {e}") from e


def initial_weights(config: TrainLmConfig, vocab_size: int):
    """``load() -> model`` for ``trainer.initialize_from_hf`` (None without it).

    The trainer calls it only when the run does not resume from its own checkpoint.
    """
    path = config.trainer.initialize_from_hf
    if path is None:
        return None

    def load():
        from loomax.hf import load_hf

        try:
            model = load_hf(path, config.model)
        except UserError as e:
            raise type(e)(f"trainer.initialize_from_hf: {e}") from e
        if model.Vocab.size != vocab_size:
            raise ConfigError(
                f"trainer.initialize_from_hf: {path} has a vocabulary of {model.Vocab.size}, the run {vocab_size}; "
                f"set model.vocab_size: {model.Vocab.size} (and use the checkpoint's tokenizer)"
            )
        logger.info("model weights from the Hugging Face checkpoint %s", path)
        return config.model.for_training(model)

    return load
