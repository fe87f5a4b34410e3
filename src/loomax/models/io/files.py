"""The two files of a saved model, without knowing what model they hold.

``model.yaml`` is text (the model section and vocabulary size, written by ``LmModel.save``);
``model.safetensors`` holds every array under its pytree path in JAX's key-string form
(``.blocks.stacked.attn.qkv.weight[<flat index 0>]``). Each file is written aside and renamed,
so saving into an existing directory replaces both in place. ``tokenizer.json``, when the
model is saved with its tokenizer, sits beside them (an earlier save's is removed otherwise).
"""

from __future__ import annotations

import os
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from loomax.atomic_files import replace_path
from loomax.errors import MissingFileError
from loomax.tree_paths import named_leaves

CONFIG_FILE = "model.yaml"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"


def is_weight(x) -> bool:
    """True for the arrays (or their shapes) that the weights file holds."""
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def weight_leaves(tree) -> list[tuple[str, object]]:
    """``(name in the weights file, leaf)`` for every weight of ``tree``, in flattening order."""
    return named_leaves(eqx.filter(tree, is_weight), sep=None, whole_named_arrays=False)


def write_files(path: str | os.PathLike, config_text: str, tree, tokenizer=None) -> None:
    """Write ``config_text``, the weights of ``tree`` and ``tokenizer`` (a ``tokenizers``
    ``Tokenizer`` or a tokenizer.json path; None removes an earlier save's) into directory
    ``path`` (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        (path / TOKENIZER_FILE).unlink(missing_ok=True)
    else:
        text = (
            Path(tokenizer).read_text() if isinstance(tokenizer, str | os.PathLike)
            else tokenizer.to_str()
        )  # fmt: skip
        replace_path(path / TOKENIZER_FILE, lambda p: p.write_text(text))
    arrays = {name: np.asarray(jax.device_get(leaf)) for name, leaf in weight_leaves(tree)}
    replace_path(
        path / WEIGHTS_FILE, lambda p: save_file(arrays, str(p), metadata={"format": "loomax"})
    )
    replace_path(path / CONFIG_FILE, lambda p: p.write_text(config_text))


def read_files(path: str | os.PathLike) -> tuple[str, dict[str, np.ndarray]]:
    """``(config text, {name: array})`` of the model saved in directory ``path``."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise MissingFileError(
            f"{path} is not a saved model (needs {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    return (path / CONFIG_FILE).read_text(), load_file(str(path / WEIGHTS_FILE))
