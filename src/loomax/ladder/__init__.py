"""The model ladder: a family of sizes trained with scaling-law budgets, and their results."""

from loomax.ladder.config import LadderConfig, Rung, base_run, rung
from loomax.ladder.model import Gpt2Configurator, LlamaConfigurator, ModelConfigurator
from loomax.ladder.results import (
    checkpoints_table,
    final_losses,
    fit_power_law,
    metrics_table,
    plot_loss_vs_compute,
)
from loomax.ladder.run import ChinchillaRunConfigurator, RunConfigurator, RunPlan
from loomax.ladder.sizes import Shape, parse_size, shape_for

__all__ = [
    "ChinchillaRunConfigurator",
    "Gpt2Configurator",
    "LadderConfig",
    "LlamaConfigurator",
    "ModelConfigurator",
    "RunConfigurator",
    "RunPlan",
    "Rung",
    "Shape",
    "base_run",
    "checkpoints_table",
    "final_losses",
    "fit_power_law",
    "metrics_table",
    "parse_size",
    "plot_loss_vs_compute",
    "rung",
    "shape_for",
]
