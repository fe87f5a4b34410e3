"""A model's adapters saved alone (``adapters.safetensors``: ``<layer>.lora_a`` / ``.lora_b``,
an expert weight's ``<moe layer>.gate_lora.lora_a`` and so on,
in the arrays' own axis order, the axis names in the metadata) and loaded onto a model with
adapters of the same shapes (the base from anywhere: a checkpoint, a Hugging Face import)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from loomax.errors import BadFileError, UserError
from loomax.models.lora.config import ADAPTER_LEAVES
from loomax.models.lora.linear import LoraLinear, adapter_layers
from loomax.models.moe.expert_adapter import ExpertAdapter

FILE = "adapters.safetensors"


def _leaves(layer) -> list[str]:
    """The adapter arrays ``layer`` holds: A, B and (DoRA) the magnitude."""
    return [leaf for leaf in ADAPTER_LEAVES if getattr(layer, leaf, None) is not None]


def save_adapters(model: Any, out_dir: str | os.PathLike) -> Path:
    """Write ``model``'s adapters (and nothing of the base) to ``out_dir/adapters.safetensors``."""
    layers = adapter_layers(model)
    if not layers:
        raise UserError("the model has no LoRA adapters (model.lora) to save")
    tensors, axes = {}, {}
    for name, layer in layers.items():
        for leaf in _leaves(layer):
            array = getattr(layer, leaf)
            tensors[f"{name}.{leaf}"] = np.asarray(jax.device_get(array.array))
            axes[f"{name}.{leaf}"] = [a.name for a in array.axes]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / FILE), metadata={"axes": json.dumps(axes)})
    return out / FILE


def load_adapters(model: Any, path: str | os.PathLike) -> Any:
    """``model`` (with adapters of the same layers and shapes) with the saved adapters in."""
    path = Path(path)
    path = path / FILE if path.is_dir() else path
    if not path.exists():
        raise BadFileError(f"{path}: no such adapters file")
    tensors = load_file(str(path))
    layers = adapter_layers(model)
    wanted = {f"{n}.{leaf}" for n, layer in layers.items() for leaf in _leaves(layer)}
    if set(tensors) != wanted:
        raise BadFileError(
            f"{path}: its adapters {sorted(set(tensors) ^ wanted)} do not match the model's"
        )

    def fill(layer: LoraLinear | ExpertAdapter, name: str) -> LoraLinear | ExpertAdapter:
        for leaf in _leaves(layer):
            like = getattr(layer, leaf)
            array = tensors[f"{name}.{leaf}"]
            if array.shape != like.array.shape:
                raise BadFileError(
                    f"{path}: {name}.{leaf} has shape {array.shape}, the model {like.array.shape}"
                )
            new = hax.named(jnp.asarray(array, like.dtype), like.axes)
            layer = eqx.tree_at(lambda m, leaf=leaf: getattr(m, leaf), layer, new)
        return layer

    by_id = {id(layer): name for name, layer in layers.items()}
    is_lora = lambda x: isinstance(x, (LoraLinear, ExpertAdapter))  # noqa: E731
    return jax.tree.map(
        lambda n: fill(n, by_id[id(n)]) if is_lora(n) else n, model, is_leaf=is_lora
    )
