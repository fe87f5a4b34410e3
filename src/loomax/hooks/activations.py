"""Activation statistics every N steps: ``activations/<where>/<name>/<stat>`` from the step itself.

On the steps this hook is due, the trainer runs a second compiled variant of the step
whose forward pass also records, per layer, the attention block's output, the MLP's input
and output and the residual stream after the block, the final normed hidden states and
the logits (block by block: the fused loss never holds them whole; ``loomax.models.blocks.taps``): mean, std, abs-max, RMS and the fraction of near-zero values
(magnitude below 1e-3 of the tensor's RMS). No second forward pass; the other steps run
the ordinary program and pay nothing. Keys: ``activations/layer_03/mlp_out/rms``,
``activations/final/std``, ``activations/logits/absmax``. With microbatches, each value is the average over them.
"""

from __future__ import annotations

from dataclasses import dataclass

from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook, StepInfo

PREFIX = "activations/"


@hook_type("activations")
class ActivationStatsHook(Hook):
    """Logs activation statistics (``loomax.models.blocks.taps``) every ``every`` steps."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Per-layer activation statistics (mean, std, abs-max, RMS, near-zero fraction) every N steps."""

        every: int = 100
        """Take and log the statistics every this many steps."""

        def __post_init__(self):
            self.check_positive("every")

    config: Config

    def activation_stats_at(self, step: int) -> bool:
        return step % self.config.every == 0

    def on_step(self, info: StepInfo) -> None:
        if not self.activation_stats_at(info.step):
            return
        stats = {k: v for k, v in info.host_metrics().items() if k.startswith(PREFIX)}
        info.log(stats)
