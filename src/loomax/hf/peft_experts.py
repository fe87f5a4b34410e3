"""Expert adapters (LoRA on a mixture of experts' weights) as PEFT ``target_parameters``.

transformers 5 keeps a MoE layer's experts as two fused 3-D parameters of one module,
``model.layers.N.mlp.experts``: ``gate_up_proj [experts, 2 x mlp, embed]`` (the gate's rows,
then the up's) and ``down_proj [experts, embed, mlp]``. PEFT (0.17 on) adapts such a
parameter with a ``ParamWrapper`` (``LoraConfig.target_parameters``): one ``lora_A``
(``experts x r, in``) and ``lora_B`` (``out, r x experts``, rank-major) whose expert ``e``
block adds ``scaling * B_e A_e`` to ``W_e``. Loomax's gate and up adapters are separate
(each its own A), so the fused ``gate_up_proj`` gets rank ``2r``: A the two A's stacked, B
block-diagonal; every other adapter of the export is padded with zeros to ``2r`` too and
``lora_alpha`` doubled, which leaves every product and scale (``alpha / r``) as it was.
Two parameters of one module nest their wrappers: the first in the module's parameter
order (``gate_up_proj``) is the inner one, its tensors under ``experts.base_layer.``.

The families whose HF experts have this layout: ``FUSED_EXPERTS``; gpt-oss (transposed,
with biases) is refused, naming the way out (merge the adapters and export the model).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from loomax.errors import UserError
from loomax.hf.family import family_of
from loomax.models.axes import Embed, Experts, Layers, Mlp
from loomax.models.lora.experts import is_moe
from loomax.models.moe.expert_adapter import RANK

FUSED_EXPERTS = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "qwen3_next")
"""HF model types whose experts are ``mlp.experts.{gate_up_proj,down_proj}``, ``[E, out, in]``."""
GATE_UP, DOWN = "gate_up_proj", "down_proj"
TARGETS = {GATE_UP: "mlp.experts.gate_up_proj", DOWN: "mlp.experts.down_proj"}
"""PEFT ``target_parameters`` of the two fused expert parameters."""


def _moe_layers(model: Any) -> list[Any]:
    found: list[Any] = []

    def visit(node):
        if is_moe(node) and any(
            getattr(node, f) is not None for f in ("gate_lora", "up_lora", "down_lora")
        ):
            found.append(node)
        return node

    jax.tree.map(visit, model, is_leaf=is_moe)
    return found


def _factors(adapter, In: str, Out: str, size: int, shape: dict[str, int]):
    """``(A [L, E, r, In], B [L, E, Out, r])`` of ``adapter`` as numpy (zeros when None)."""
    L, E = shape[Layers], shape[Experts]
    if adapter is None:
        return np.zeros((L, E, size, shape[In])), np.zeros((L, E, shape[Out], size))
    a = adapter.lora_a.rearrange((Layers, Experts, RANK, In)).array
    b = adapter.lora_b.rearrange((Layers, Experts, Out, RANK)).array
    return np.asarray(jax.device_get(a), np.float64), np.asarray(jax.device_get(b), np.float64)


def _peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's ``A [E, R, in]``, ``B [E, out, R]`` as PEFT's ``lora_A [E R, in]``,
    ``lora_B [out, R E]`` (B rank-major, as ``ParamWrapper`` reshapes it)."""
    E, R, n_in = a.shape
    return a.reshape(E * R, n_in), b.transpose(1, 2, 0).reshape(b.shape[1], R * E)


def expert_tensors(model: Any, prefix: str, rank: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """PEFT's tensors of ``model``'s expert adapters (rank ``2 x rank``, float32) under
    ``prefix``, and the ``target_parameters``; ``({}, [])`` when the model has none."""
    layers = _moe_layers(model)
    if not layers:
        return {}, []
    family = family_of(model.config)
    if family.hf_model_type not in FUSED_EXPERTS:
        raise UserError(
            f"{family.hf_model_type}: its Hugging Face experts are not laid out as PEFT's "
            f"target_parameters export expects ({', '.join(FUSED_EXPERTS)}); merge the "
            "adapters (merge_lora) and export the whole model"
        )
    first = {id(p.where(model)): p.first_layer for p in family.hf_params() if p.per_expert}
    tensors: dict[str, np.ndarray] = {}
    targets: set[str] = set()
    for mlp in layers:
        if Layers not in {a.name for a in mlp.gate.axes}:
            raise UserError("PEFT export of expert adapters needs the layers' stacked experts")
        shape = {a.name: a.size for a in mlp.gate.axes}
        r = rank
        ga, gb = _factors(mlp.gate_lora, Embed, Mlp, r, shape)
        ua, ub = _factors(mlp.up_lora, Embed, Mlp, r, shape)
        da, db = _factors(mlp.down_lora, Mlp, Embed, r, shape)
        fused_a = np.concatenate([ga, ua], axis=2)  # [L, E, 2r, embed]
        fused_b = np.zeros((*gb.shape[:2], 2 * gb.shape[2], 2 * r))  # block-diagonal
        fused_b[:, :, : gb.shape[2], :r], fused_b[:, :, gb.shape[2] :, r:] = gb, ub
        down_a = np.concatenate([da, np.zeros_like(da)], axis=2)
        down_b = np.concatenate([db, np.zeros_like(db)], axis=3)
        parts = {}
        if mlp.gate_lora is not None or mlp.up_lora is not None:
            parts[GATE_UP] = (fused_a, fused_b)
        if mlp.down_lora is not None:
            parts[DOWN] = (down_a, down_b)
        targets |= set(parts)
        offset = first.get(id(mlp.gate), 0)
        for i in range(shape[Layers]):
            module = f"{prefix}model.layers.{offset + i}.mlp.experts."
            for k, (a, b) in enumerate(parts.values()):
                nested = "base_layer." * (len(parts) - 1 - k)  # the first one is innermost
                lora_a, lora_b = _peft(a[i], b[i])
                tensors[f"{module}{nested}lora_A.weight"] = lora_a.astype(np.float32)
                tensors[f"{module}{nested}lora_B.weight"] = lora_b.astype(np.float32)
    return tensors, [TARGETS[t] for t in (GATE_UP, DOWN) if t in targets]


def pad_rank(name: str, array: np.ndarray, rank: int) -> np.ndarray:
    """A linear layer's PEFT ``lora_A`` (``r, in``) or ``lora_B`` (``out, r``) padded with
    zeros to rank ``rank``."""
    if name.endswith("lora_A.weight"):
        return np.pad(array, ((0, rank - array.shape[0]), (0, 0)))
    if name.endswith("lora_B.weight"):
        return np.pad(array, ((0, 0), (0, rank - array.shape[1])))
    return array
