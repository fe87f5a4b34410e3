"""``model.save(dir)`` / ``load_model(dir)``: the model's config (YAML) and weights (safetensors).

No pickle: ``model.yaml`` holds the ``model`` section (with ``type``) and the vocabulary
size; ``model.safetensors`` holds every array under its pytree path. Saving into an
existing directory replaces both files in place (each written aside, then renamed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import yaml
from safetensors.numpy import load_file, save_file

from loomax.models.config import LmConfig, LmModel
from loomax.models.gpt2 import Gpt2Config

CONFIG_FILE = "model.yaml"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class SavedModel:
    """What ``model.yaml`` holds."""

    model: LmConfig = field(default_factory=Gpt2Config)
    vocab_size: int = 0


def _is_weight(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _flat(tree) -> list[tuple[str, object]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, _is_weight))
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def _replace(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_model(model: LmModel, path: str | os.PathLike) -> None:
    """Write ``model`` to directory ``path`` (created if needed, updated in place if it exists)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(jax.device_get(leaf)) for name, leaf in _flat(model)}
    saved = SavedModel(model.config, model.Vocab.size)
    _replace(
        path / WEIGHTS_FILE, lambda p: save_file(arrays, str(p), metadata={"format": "loomax"})
    )
    _replace(path / CONFIG_FILE, lambda p: p.write_text(draccus.dump(saved)))


def load_model(path: str | os.PathLike) -> LmModel:
    """The model saved in directory ``path``: its architecture rebuilt from ``model.yaml``."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a saved model (needs {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    saved = draccus.decode(SavedModel, yaml.safe_load((path / CONFIG_FILE).read_text()))
    skeleton = jax.eval_shape(
        lambda: saved.model.build(saved.vocab_size, key=jax.random.PRNGKey(0))
    )
    arrays = load_file(str(path / WEIGHTS_FILE))
    expected = _flat(skeleton)
    missing = sorted({name for name, _ in expected} - set(arrays))
    if missing:
        raise ValueError(
            f"{path / WEIGHTS_FILE} lacks {missing[:5]} for a {type(saved.model).__name__}"
        )
    filled = []
    for name, shape in expected:
        value = arrays[name]
        if value.shape != shape.shape:
            raise ValueError(
                f"{path / WEIGHTS_FILE}: {name} has shape {value.shape}, expected {shape.shape}"
            )
        filled.append(jnp.asarray(value, shape.dtype))
    params, static = eqx.partition(skeleton, _is_weight)
    treedef = jax.tree_util.tree_structure(params)
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, filled), static)
