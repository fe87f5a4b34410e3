"""Routing-collapse warning: an expert whose load stays near zero, which a falling loss hides.

A mixture-of-experts model reports ``moe/layer_<i>/load_min`` every step: the least-used
expert's share of the assignments times the number of experts (1 = balanced, 0 = unused).
This hook watches it on each finished step; when a layer's value stays below ``threshold``
for ``patience`` consecutive steps, it logs a warning naming the layer (once, until the
layer recovers), and logs ``moe/collapsed_layers``: how many layers are collapsed now.
Dense models report no such metric; the hook then does nothing.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

LOAD_MIN = re.compile(r"^moe/(layer_\d+)/load_min$")


@hook_type("router_collapse")
class RouterCollapseHook(Hook):
    """Warns when an MoE layer's least-used expert stays near zero load for ``patience`` steps."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Warn when an expert's load stays near zero (routing collapse)."""

        threshold: float = 0.05
        """Load (share of assignments x number of experts; 1 = balanced) under which an expert counts as unused."""
        patience: int = 100
        """Consecutive steps under the threshold before the warning."""
        every: int = 10
        """Log ``moe/collapsed_layers`` every this many steps."""

        def __post_init__(self):
            self.check_positive("threshold", "patience", "every")

    config: Config
    sees_every_step = True  # it judges every finished step and keeps its own cadence

    def __init__(self, config: Config | None = None, /, **settings: Any):
        super().__init__(config, **settings)
        self.below: dict[str, int] = {}
        """Consecutive steps each layer's least-used expert has been under the threshold."""

    def observe(self, metrics: dict[str, Any]) -> list[str]:
        """Judge one finished step; returns the layers that just reached ``patience``."""
        newly = []
        for name, value in metrics.items():
            match = LOAD_MIN.match(name)
            if match is None:
                continue
            layer = match.group(1)
            if float(value) >= self.config.threshold:
                self.below[layer] = 0
                continue
            self.below[layer] = self.below.get(layer, 0) + 1
            if self.below[layer] == self.config.patience:
                newly.append(layer)
        return newly

    @property
    def collapsed(self) -> list[str]:
        return sorted(k for k, n in self.below.items() if n >= self.config.patience)

    def on_step(self, info: StepInfo) -> None:
        if info.previous is not None:
            for layer in self.observe(info.previous.metrics):
                logger.warning(
                    "routing collapse: in MoE %s an expert's load stayed under %.3g of a "
                    "balanced share for %d steps (see moe/%s/load_min; raise "
                    "model.moe.load_balance_loss_weight?)",
                    layer,
                    self.config.threshold,
                    self.config.patience,
                    layer,
                )
        if self.below and info.step % self.config.every == 0:
            info.log({"moe/collapsed_layers": len(self.collapsed)})

    def state_dict(self) -> dict[str, Any]:
        return {"below": dict(self.below)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.below = dict(state.get("below", {}))
