"""Gradient, parameter and update norms: global and per parameter, optionally histograms.

Computed inside the step (a ``JitHook``, no second pass) on the steps the hook is due;
the host part logs them. Per-parameter keys are the parameter's path, e.g.
``norms/grad/blocks/attn/qkv/weight``; stacked layers give one value per layer
(``.../weight/3``) when ``per_layer`` is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook, StepInfo
from loomax.train.step import JitHook, StepContext
from loomax.tree_paths import named_leaves

KINDS = ("grad", "param", "update")
HIST_BINS = 32
HIST_RANGE = (-12.0, 4.0)
"""Histogram of log10 |value| over this range (values outside land in the end bins)."""


def _named_leaves(tree) -> list[tuple[str, jax.Array, bool]]:
    """(path, array, has a layers axis) for every inexact array of ``tree``."""
    out = []
    for name, leaf in named_leaves(tree):
        stacked = isinstance(leaf, hax.NamedArray) and "layers" in [a.name for a in leaf.axes]
        array = leaf.rearrange(("layers", ...)).array if stacked else getattr(leaf, "array", leaf)
        if eqx.is_inexact_array(array):
            out.append((name, array, stacked))
    return out


def norm_metrics(
    context: StepContext, *, per_layer: bool, histograms: bool
) -> dict[str, jax.Array]:
    """The norms (and histograms) of the step's gradients, parameters and updates."""
    trees = {
        "grad": context.grads,
        "param": eqx.filter(context.model, eqx.is_inexact_array),
        "update": context.updates,
    }
    out: dict[str, jax.Array] = {}
    for kind, tree in trees.items():
        out[f"norms/{kind}"] = optax.tree.norm(tree).astype(jnp.float32)
        if per_layer:
            for name, array, stacked in _named_leaves(tree):
                x = array.astype(jnp.float32)
                axes = tuple(range(1, x.ndim)) if stacked else None
                out[f"norms/{kind}/{name}"] = jnp.sqrt(jnp.sum(x * x, axis=axes))
        if histograms:
            flat = jnp.concatenate(
                [a.reshape(-1).astype(jnp.float32) for _, a, _ in _named_leaves(tree)]
            )
            logs = jnp.clip(jnp.log10(jnp.abs(flat) + 1e-30), *HIST_RANGE)
            out[f"histograms/{kind}"] = jnp.histogram(logs, bins=HIST_BINS, range=HIST_RANGE)[0]
    return out


@hook_type("norms")
class NormsHook(Hook):
    """Computes norms in the step every ``every`` steps (a ``JitHook`` of its own) and logs them."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Gradient, parameter and update norms (global and per parameter), optionally histograms."""

        every: int = 10
        """Compute and log every this many steps."""
        per_layer: bool = True
        """Also log the norm of every parameter (per layer for stacked layers)."""
        histograms: bool = False
        """Also log histograms of log10 |value| (32 bins over [-12, 4])."""

        def __post_init__(self):
            self.check_positive("every")

    config: Config

    def __init__(self, config: Config | None = None, /, **settings: Any):
        super().__init__(config, **settings)
        c = self.config
        fn = lambda ctx: norm_metrics(ctx, per_layer=c.per_layer, histograms=c.histograms)  # noqa: E731
        self._jit = JitHook(fn, every=c.every)

    def jit_hooks(self) -> list[JitHook]:
        return [self._jit]

    def on_step(self, info: StepInfo) -> None:
        values = {}
        for key, value in info.traced(self._jit).items():
            value = np.asarray(value)
            if value.ndim == 0:
                values[key] = float(value)
            elif key.startswith("histograms/"):
                values[key] = value.tolist()
            else:
                values.update({f"{key}/{i}": float(v) for i, v in enumerate(value)})
        info.log(values)
