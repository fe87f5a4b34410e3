"""A model's LoRA adapters as a PEFT adapter: ``adapter_config.json`` + ``adapter_model.safetensors``.

``peft.PeftModel.from_pretrained(hf_model, out_dir)`` loads it onto the transformers model
of the base (the Loomax export of the model without adapters, ``export_hf``), with the
same logits. Each adapted layer is found in its family's HF table (``hf_params``) by its
weight, and its adapter written under PEFT's names,
``base_model.model.<HF module>.lora_A.weight`` (rank x in) and ``.lora_B.weight``
(out x rank), per layer, its axes laid out as the HF weight's in and out dimensions. A layer
that is one part of a fused HF tensor (Phi 3's ``qkv_proj``, ``gate_up_proj``) has no PEFT
equivalent and is refused; merge the adapters (``merge_lora``) and export the whole model.
Adapters on a mixture of experts' weights go as PEFT ``target_parameters`` on transformers'
fused expert parameters (``peft_experts``: the export's rank then doubled, zero-padded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from loomax.errors import UserError
from loomax.hf.convert import export_hf
from loomax.hf.family import family_of
from loomax.hf.peft_experts import expert_tensors, pad_rank
from loomax.models.io.hf_layout import Param
from loomax.models.lora.linear import RANK, LoraLinear, adapter_layers, without_adapters

PREFIX = "base_model.model."
"""PEFT's prefix of every tensor name of a causal LM's adapter."""


def _names(dim) -> set[str]:
    return {dim} if isinstance(dim, str) else set(dim)


def _axis_names(spec) -> set[str]:
    return {spec.name} if hasattr(spec, "name") else {a.name for a in spec}


def adapter_params(model: Any) -> list[tuple[Param, ...]]:
    """The tables of every adapted linear layer of ``model`` under PEFT's names: A, B and
    (DoRA) the magnitude ``lora_magnitude_vector`` (the expert adapters: ``peft_experts``)."""
    layers = {n: x for n, x in adapter_layers(model).items() if isinstance(x, LoraLinear)}
    by_weight = {id(layer.weight): (name, layer) for name, layer in layers.items()}
    out, seen = [], set()
    for p in family_of(model.config).hf_params():
        hit = by_weight.get(id(p.where(model)))
        if hit is None:
            continue
        name, layer = hit
        if p.rows is not None:
            raise UserError(
                f"{name}: its HF tensor {p.hf_name} is fused with others, which PEFT cannot "
                "adapt part of; merge the adapters (merge_lora) and export the whole model"
            )
        ins = _axis_names(layer.In)
        in_dims = tuple(d for d in p.dims if _names(d) <= ins)
        out_dims = tuple(d for d in p.dims if not _names(d) <= ins)
        module = PREFIX + p.hf_name.removesuffix(".weight")
        a = Param(f"{module}.lora_A.weight", lambda _, x=layer.lora_a: x, (RANK, *in_dims))
        b = Param(f"{module}.lora_B.weight", lambda _, x=layer.lora_b: x, (*out_dims, RANK))
        m = ()
        if layer.lora_m is not None:  # DoRA: one magnitude per HF output row
            magnitude = lambda _, x=layer: x.magnitude()  # noqa: E731
            m = (Param(f"{module}.lora_magnitude_vector", magnitude, out_dims),)
        out.append((a, b, *m))
        seen.add(name)
    missing = sorted(set(layers) - seen)
    if missing:
        raise UserError(f"LoRA adapters with no Hugging Face tensor to attach to: {missing}")
    return out


def export_peft(
    model: Any, out_dir: str | os.PathLike, *, base_model_name_or_path: str | None = None
) -> Path:
    """Write ``model``'s adapters as a PEFT LoRA adapter in ``out_dir``; returns the directory."""
    lora = model.config.lora
    if lora is None:
        raise UserError("the model has no LoRA adapters (model.lora) to export")
    tensors: dict[str, np.ndarray] = {}
    for params in adapter_params(model):
        for p in params:
            tensors.update(p.export(model))
    modules = sorted({n.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for n in tensors})
    experts, parameters = expert_tensors(model, PREFIX, lora.rank)
    if not tensors and not experts:
        raise UserError("the model has no LoRA adapters (model.lora) to export")
    widen = 2 if experts else 1  # the fused gate_up_proj's rank 2r (peft_experts): all at 2r
    if widen > 1:
        tensors = {k: pad_rank(k, v, widen * lora.rank) for k, v in tensors.items()}
    tensors.update(experts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v.astype(np.float32)) for k, v in tensors.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": widen * lora.rank,
        "lora_alpha": widen * lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules or None,
        "target_parameters": parameters or None,
        "bias": "none",
        "fan_in_fan_out": family_of(model.config).hf_model_type == "gpt2",
        "use_rslora": False,
        "use_dora": lora.dora,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def export_base_and_adapter(model: Any, base_dir, adapter_dir, **export_args) -> None:
    """The base model (``export_hf`` of ``model`` without adapters) in ``base_dir`` and the
    adapter (``export_peft``) in ``adapter_dir``, naming the base."""
    export_hf(without_adapters(model), base_dir, **export_args)
    export_peft(model, adapter_dir, base_model_name_or_path=str(base_dir))
