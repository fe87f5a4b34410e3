"""Optimizers (optax chains chosen by ``optimizer.type``) and learning-rate schedules."""

from loomax.config import import_package_modules
from loomax.optim.adafactor import AdafactorConfig
from loomax.optim.adam import AdamConfig
from loomax.optim.config import ClipUpdateNormConfig, OptimizerConfig, SkipBadStepsConfig
from loomax.optim.lion import LionConfig
from loomax.optim.mask import parameter_names, regex_mask, weight_decay_mask
from loomax.optim.muon import MuonConfig
from loomax.optim.schedule import LrSchedule, Phase, warmup_then_decay

__all__ = [
    "AdafactorConfig",
    "AdamConfig",
    "ClipUpdateNormConfig",
    "LionConfig",
    "LrSchedule",
    "MuonConfig",
    "OptimizerConfig",
    "Phase",
    "SkipBadStepsConfig",
    "parameter_names",
    "regex_mask",
    "warmup_then_decay",
    "weight_decay_mask",
]

import_package_modules(__name__, __path__)  # every module: a new file registers its optimizer types
