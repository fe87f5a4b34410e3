"""Where a run's first weights come from: a fresh init, or a Hugging Face checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loomax.config import ConfigError
from loomax.errors import UserError
from loomax.lm.config import TrainLmConfig
from loomax.models.config import LmConfig

logger = logging.getLogger(__name__)


def initial_model(config: TrainLmConfig, vocab_size: int):
    """``init(key) -> model``: the fresh weights of ``config.model``."""
    return lambda key: config.model.for_training(config.model.build(vocab_size, key=key))


def hf_source(given: Mapping[tuple[str, ...], Any]) -> str | None:
    """``trainer.initialize_from_hf`` as the run gave it (``loomax.cli_parser.given_values``)."""
    path = given.get(("trainer", "initialize_from_hf"))
    return None if path in (None, "", "null", "None") else str(path)


def hf_type_args(path: str | None, given: Mapping[tuple[str, ...], Any]) -> list[str]:
    """``["--model.type", T]``, T the family of the Hugging Face checkpoint at ``path`` by its
    config.json's ``model_type``, to parse a run config whose model comes from it with that
    family's keys; nothing when the run sets ``model.type`` or config.json cannot tell (its
    error comes when the model is read, ``with_hf_model``)."""
    if path is None or ("model", "type") in given:
        return []
    from loomax.hf.family import families

    try:
        kind = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return []
    family = families().get(kind)
    return [] if family is None else ["--model.type", LmConfig.get_choice_name(family)]


def with_hf_model(config: TrainLmConfig, given: Iterable[Sequence[str]]) -> TrainLmConfig:
    """``config`` whose ``model`` is read from ``trainer.initialize_from_hf``'s config.json
    (family, architecture, vocabulary), the ``model`` keys the run set itself (``given``:
    the run's key paths, ``loomax.cli_parser.given_values``) winning; unchanged without it.
    An architecture key that disagrees with config.json is refused, naming both names."""
    path = config.trainer.initialize_from_hf
    if path is None:
        return config
    from loomax.hf import hf_model_config

    own = [tuple(k[1:]) for k in given if k[0] == "model" and len(k) > 1]
    try:
        model = hf_model_config(path, config.model, own)
    except UserError as e:  # the file, the flag or key that named it
        raise type(e)(f"trainer.initialize_from_hf: {e}") from e
    return dataclasses.replace(config, model=model)


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
