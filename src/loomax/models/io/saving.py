"""``load_model(dir)``: the model that ``model.save(dir)`` wrote, rebuilt exactly (and,
with ``with_tokenizer=True``, the tokenizer saved with it).

No pickle: ``model.yaml`` holds the ``model`` section (with ``type``) and the vocabulary
size (``SavedModel``); ``model.safetensors`` every array under its pytree path (see
``loomax.models.io.files``). Sits above every model module: the ``type`` is resolved through
``LmConfig``'s registry, which importing ``loomax.models`` fills.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, overload

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import yaml
from tokenizers import Tokenizer

from loomax.errors import BadFileError
from loomax.models.config import LmModel, SavedModel
from loomax.models.io.files import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    is_weight,
    read_files,
    weight_leaves,
)

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "SavedModel", "load_model", "save_model"]


def save_model(model: LmModel, path: str | os.PathLike, tokenizer=None) -> None:
    """Write ``model`` (and ``tokenizer``) to directory ``path``: ``model.save(path, tokenizer)``."""
    model.save(path, tokenizer=tokenizer)


@overload
def load_model(path: str | os.PathLike) -> LmModel: ...
@overload
def load_model(
    path: str | os.PathLike, *, with_tokenizer: Literal[True]
) -> tuple[LmModel, Tokenizer | None]: ...
def load_model(path: str | os.PathLike, *, with_tokenizer: bool = False):
    """The model saved in directory ``path``: its architecture rebuilt from ``model.yaml``.
    With ``with_tokenizer``, ``(model, tokenizer)``: the tokenizer saved with it, or None."""
    model = _load_weights(path)
    if not with_tokenizer:
        return model
    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        return model, None
    tokenizer = Tokenizer.from_file(str(file))
    if tokenizer.get_vocab_size() > model.Vocab.size:
        raise BadFileError(
            f"{file} has {tokenizer.get_vocab_size()} tokens, more than the model's "
            f"vocabulary of {model.Vocab.size}: it is not this model's tokenizer"
        )
    return model, tokenizer


def _load_weights(path: str | os.PathLike) -> LmModel:
    weights_file = Path(path) / WEIGHTS_FILE
    config_text, arrays = read_files(path)
    saved = draccus.decode(SavedModel, yaml.safe_load(config_text))
    skeleton = jax.eval_shape(
        lambda: saved.model.build(saved.vocab_size, key=jax.random.PRNGKey(0))
    )
    expected = weight_leaves(skeleton)
    missing = sorted({name for name, _ in expected} - set(arrays))
    if missing:
        raise BadFileError(f"{weights_file} lacks {missing[:5]} for a {type(saved.model).__name__}")
    filled = []
    for name, shape in expected:
        value = arrays[name]
        if value.shape != shape.shape:
            raise BadFileError(
                f"{weights_file}: {name} has shape {value.shape}, expected {shape.shape}"
            )
        filled.append(jnp.asarray(value, shape.dtype))
    params, static = eqx.partition(skeleton, is_weight)
    treedef = jax.tree_util.tree_structure(params)
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, filled), static)
