"""Gradient, parameter and update norms: global and per parameter, optionally histograms.

Computed inside the step (a ``JitHook``, no second pass) on the steps the hook is due;
the host part logs them. Per-parameter keys are the parameter's path, e.g.
``norms/grad/blocks/attn/qkv/weight``; stacked layers give one value per layer
(``.../weight/3``) when ``per_layer`` is on. With ``spectral`` on, the largest singular
value of every linear layer's weight (its output axes by its input axes), found by power
iteration, beside them: ``norms/spectral/blocks/mlp/up/weight/3``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np

from loomax.optim.global_norm import global_norm
from loomax.train.hook_config import HookConfig, hook_type
from loomax.train.hooks import Hook, StepInfo
from loomax.train.step import JitHook, StepContext
from loomax.tree_paths import named_leaves, path_name

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


def linear_matrices(model: Any) -> list[tuple[str, jax.Array, bool]]:
    """(path of the weight, (layers, out, in) array, stacked) for every ``haliax.nn.Linear``
    of ``model``: its output axes flattened into rows, its input axes into columns."""
    is_linear = lambda x: isinstance(x, hnn.Linear)  # noqa: E731
    leaves, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_linear)
    out = []
    for path, leaf in leaves:
        if not is_linear(leaf) or not eqx.is_inexact_array(getattr(leaf.weight, "array", None)):
            continue
        rows, cols = _axis_names(leaf.Out), _axis_names(leaf.In)
        weight = leaf.weight
        stacked = "layers" in [a.name for a in weight.axes]
        array = weight.rearrange(tuple((["layers"] if stacked else []) + rows + cols)).array
        m, n = (int(np.prod([weight.axis_size(a) for a in axes])) for axes in (rows, cols))
        out.append((path_name(path) + "/weight", array.reshape(-1, m, n), stacked))
    return out


def _axis_names(spec: Any) -> list[str]:
    return [a.name for a in hax.axis.axis_spec_to_tuple(spec)]


def spectral_norms(model: Any, iterations: int) -> dict[str, jax.Array]:
    """``norms/spectral/<weight>``: the largest singular value of each linear layer's weight
    (one per layer when stacked) after ``iterations`` of power iteration from a fixed start."""
    out = {}
    for name, w, stacked in linear_matrices(model):
        w = w.astype(jnp.float32)
        v = jax.random.normal(jax.random.PRNGKey(0), (w.shape[0], w.shape[2]), jnp.float32)

        def power(_, v, w=w):
            u = _unit(jnp.einsum("lmn,ln->lm", w, v))
            return _unit(jnp.einsum("lmn,lm->ln", w, u))

        v = jax.lax.fori_loop(0, iterations, power, _unit(v))
        sigma = jnp.linalg.norm(jnp.einsum("lmn,ln->lm", w, v), axis=-1)
        out[f"norms/spectral/{name}"] = sigma if stacked else sigma[0]
    return out


def _unit(x: jax.Array) -> jax.Array:
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-30)


def norm_metrics(
    context: StepContext,
    *,
    per_layer: bool,
    histograms: bool,
    spectral_iterations: int = 0,
) -> dict[str, jax.Array]:
    """The norms (and histograms) of the step's gradients, parameters and updates."""
    trees = {
        "grad": context.grads,
        "param": eqx.filter(context.model, eqx.is_inexact_array),
        "update": context.updates,
    }
    out: dict[str, jax.Array] = {}
    for kind, tree in trees.items():
        out[f"norms/{kind}"] = global_norm(tree).astype(jnp.float32)
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
    if spectral_iterations:
        out.update(spectral_norms(context.model, spectral_iterations))
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
        spectral: bool = False
        """Also log the spectral norm (largest singular value) of every linear layer's weight."""
        power_iterations: int = 50
        """Power-iteration steps per spectral norm (from a fixed start; it nears the value from below)."""

        def __post_init__(self):
            self.check_positive("every", "power_iterations")

    config: Config

    def __init__(self, config: Config | None = None, /, **settings: Any):
        super().__init__(config, **settings)
        c = self.config
        spectral = c.power_iterations if c.spectral else 0

        def fn(ctx):
            return norm_metrics(
                ctx, per_layer=c.per_layer, histograms=c.histograms, spectral_iterations=spectral
            )

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
