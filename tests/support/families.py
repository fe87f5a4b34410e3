"""Tiny configs of every registered model family, for the suites that run over all of them.

Nothing here lists families: ``model_types()`` is ``LmConfig``'s registry, and
``tiny_config`` fills a family's own fields from one tiny shape (a family's other fields
keep their defaults), so a new family is in every such suite once it is registered.
"""

from __future__ import annotations

import dataclasses

from loomax.config_reference import registry_members
from loomax.models import LmConfig

SHAPE = dict(
    seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2
)  # fmt: skip
"""The tiny shape; each key is used by the families that have that field."""
WINDOWS = dict(sliding_window=6)
"""Tiny windows, for the families whose window is on by default (shorter than the sequence)."""
EXPERTS = dict(num_experts=4, num_experts_per_tok=2)
"""Tiny mixtures of experts, for the families with a ``moe`` section (their routing kept)."""


def model_types() -> list[str]:
    """Every built-in ``model.type``."""
    return [name for name, _ in registry_members(LmConfig)]


def tiny_config(model_type: str, **overrides) -> LmConfig:
    """A tiny config of ``model_type``: ``SHAPE`` where the family has the field, then ``overrides``."""
    cls = LmConfig.get_choice_class(model_type)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    shape = {k: v for k, v in SHAPE.items() if k in defaults}
    shape |= {k: v for k, v in WINDOWS.items() if defaults.get(k) is not None}
    if "moe" in defaults:  # the family's routing, with few experts
        shape["moe"] = dataclasses.replace(cls().moe, **EXPERTS)
    return cls(**{**shape, **overrides})
