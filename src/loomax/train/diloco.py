"""DiLoCo and streaming DiLoCo: workers (the mesh's ``replica`` groups) train alone for H
steps, then an outer optimizer applies their averaged pseudo-gradient to the shared model.

The ``TrainerState`` keeps its meaning: ``model`` is the shared (outer) model, as of its last
sync, which is what is evaluated and exported. ``opt_state`` is a ``DiLoCoState``: each
worker's trained parameters and inner optimizer state, stacked on a ``diloco_workers`` axis
that the parameter mapping splits over ``replica``, and one outer optimizer state per
fragment. Inner steps are the ordinary step ``vmap``-ed over the workers, with the batch
split over ``data`` only; no value crosses ``replica`` until a sync. The trainer runs a
separate program at the steps that end a (fragment's) period: the inner step followed by
the outer update of that fragment, the only collective across workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from loomax.optim.global_norm import global_norm
from loomax.train.fragments import Piece, nodes, plan_fragments, put, synced_at, take
from loomax.train.state import TrainerState
from loomax.train.step import LossFn, Metrics, make_train_step, trainable_mask, trainable_params

WORKERS = "diloco_workers"
"""The named axis of per-worker copies; the parameter mapping sends it to ``replica``."""


@dataclass(frozen=True)
class DiLoCoConfig:
    """``trainer.diloco``: local SGD across the ``replica`` groups of the mesh (DiLoCo)."""

    inner_steps: int = 100
    """H: steps each worker takes alone between two syncs of a fragment."""
    outer_learning_rate: float = 0.7
    """Learning rate of the outer optimizer (SGD with Nesterov momentum) on the pseudo-gradient."""
    outer_momentum: float = 0.9
    """Nesterov momentum of the outer optimizer; 0 = plain SGD."""
    bf16_pseudo_gradients: bool = False
    """Send the pseudo-gradients (start - end of a period) in bfloat16, halving the bytes of a sync."""
    fragments: int = 1
    """Streaming DiLoCo: split the parameters into this many fragments, synced at staggered steps (must divide inner_steps)."""

    def __post_init__(self):
        if self.inner_steps < 1:
            raise ValueError(f"trainer.diloco.inner_steps must be >= 1, got {self.inner_steps}")
        if self.outer_learning_rate <= 0:
            raise ValueError(
                f"trainer.diloco.outer_learning_rate must be > 0, got {self.outer_learning_rate}"
            )
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(
                f"trainer.diloco.outer_momentum must be in [0, 1), got {self.outer_momentum}"
            )
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise ValueError(
                f"trainer.diloco.fragments ({self.fragments}) must be >= 1 and divide "
                f"trainer.diloco.inner_steps ({self.inner_steps})"
            )

    def outer_optimizer(self) -> optax.GradientTransformation:
        """SGD at ``outer_learning_rate`` with Nesterov ``outer_momentum`` (none at 0)."""
        momentum = self.outer_momentum or None
        return optax.sgd(self.outer_learning_rate, momentum=momentum, nesterov=bool(momentum))

    def synced_at(self, step: int) -> int | None:
        """The fragment synced at the end of step ``step`` (from 1), or None (an inner step)."""
        return synced_at(step, self.inner_steps, self.fragments)


class DiLoCoState(eqx.Module):
    """The optimizer state of a DiLoCo run (``TrainerState.opt_state``)."""

    workers: Any
    """Each worker's trained parameters, stacked on ``diloco_workers``."""
    inner: Any
    """Each worker's inner optimizer state, stacked on ``diloco_workers``."""
    outer: tuple
    """The outer optimizer state of each fragment (over that fragment's parameters)."""


def stack(tree: Any, count: int) -> Any:
    """``count`` copies of every array of ``tree`` on a new leading ``diloco_workers`` axis."""
    workers = hax.Axis(WORKERS, count)

    def copies(x):
        if hax.is_named_array(x):
            return hax.NamedArray(
                jnp.broadcast_to(x.array, (count, *x.array.shape)), (workers, *x.axes)
            )
        x = jnp.asarray(x)
        dims = tuple(hax.Axis(f"{WORKERS}_dim{i}", n) for i, n in enumerate(x.shape))
        return hax.NamedArray(jnp.broadcast_to(x, (count, *x.shape)), (workers, *dims))

    return jax.tree.map(copies, tree, is_leaf=hax.is_named_array)


class DiLoCo:
    """DiLoCo of ``inner`` (the run's optimizer, per worker) and ``outer`` over ``num_workers``.

    ``init(params)`` is the state a run starts from (the trainer uses it as the optimizer's
    init); ``make_step(..., sync=f)`` builds the step that ends with the sync of fragment
    ``f`` (None: an inner step only).
    """

    def __init__(
        self,
        config: DiLoCoConfig,
        inner: optax.GradientTransformation,
        num_workers: int,
        outer: optax.GradientTransformation | None = None,
    ):
        self.config = config
        self.inner = inner
        self.outer = outer or config.outer_optimizer()
        self.num_workers = num_workers

    def fragments(self, params: Any) -> tuple[tuple[Piece, ...], ...]:
        return plan_fragments(params, self.config.fragments)

    def init(self, params: Any) -> DiLoCoState:
        """Every worker starts from ``params`` (the trained parameters) and a fresh inner state."""
        leaves = nodes(params)
        outer = tuple(self.outer.init(take(leaves, f)) for f in self.fragments(params))
        return DiLoCoState(
            stack(params, self.num_workers), stack(self.inner.init(params), self.num_workers), outer
        )

    def make_step(
        self,
        loss_fn: LossFn,
        *,
        mp: jmp.Policy,
        compute_mapping: dict,
        num_microbatches: int = 1,
        lr_schedule: optax.Schedule | None = None,
        freeze: Sequence[str] = (),
        sync: int | None = None,
    ) -> Callable[[TrainerState, Any], tuple[TrainerState, Metrics]]:
        """The step: every worker's inner step, then (``sync`` = a fragment) that fragment's
        outer step. ``compute_mapping`` lays out a worker's activations (``batch`` over
        ``data`` only). Metrics are per worker: arrays of one value per worker."""
        inner_step = make_train_step(
            loss_fn, self.inner, mp=mp, num_microbatches=num_microbatches,
            lr_schedule=lr_schedule, freeze=freeze,
        )  # fmt: skip
        count = self.num_workers

        def step(state: TrainerState, batch: Any) -> tuple[TrainerState, Metrics]:
            dl: DiLoCoState = state.opt_state
            params = trainable_params(state.model, freeze)
            rest = eqx.filter(state.model, trainable_mask(state.model, freeze), inverse=True)
            params_def = jax.tree.structure(params)
            inner_def = jax.tree.structure(jax.eval_shape(self.inner.init, params))
            key, worker_key = jax.random.split(state.key)

            def one(worker_leaves, inner_leaves, key, rows):
                model = eqx.combine(jax.tree.unflatten(params_def, worker_leaves), rest)
                inner = jax.tree.unflatten(inner_def, inner_leaves)
                with hax.axis_mapping(compute_mapping):
                    new, metrics = inner_step(TrainerState(state.step, model, inner, key), rows)
                trained = trainable_params(new.model, freeze)
                return jax.tree.leaves(trained), jax.tree.leaves(new.opt_state), metrics

            rows = jax.tree.map(lambda x: x.reshape(count, -1, *x.shape[1:]), batch)
            keys = jax.random.split(worker_key, count)
            worker_leaves, inner_leaves, metrics = jax.vmap(one, spmd_axis_name="replica")(
                jax.tree.leaves(dl.workers), jax.tree.leaves(dl.inner), keys, rows
            )
            workers = jax.tree.unflatten(jax.tree.structure(dl.workers), worker_leaves)
            inner = jax.tree.unflatten(jax.tree.structure(dl.inner), inner_leaves)
            model, outer = state.model, dl.outer
            if sync is not None:
                pieces = self.fragments(params)[sync]
                params, workers, outer_f, norm = self._sync(params, workers, dl.outer[sync], pieces)
                outer = tuple(outer_f if f == sync else s for f, s in enumerate(dl.outer))
                model = eqx.combine(params, rest)
                metrics["diloco/pseudo_grad_norm"] = jnp.broadcast_to(norm, (count,))
            new_state = DiLoCoState(workers, inner, outer)
            return TrainerState(state.step + 1, model, new_state, key, state.extras), metrics

        return step

    def _sync(self, params, workers, outer_state, pieces):
        """The outer step of one fragment: the mean over workers of (shared - worker), in
        bfloat16 if asked, through the outer optimizer; every worker restarts from the result."""
        shared = take(nodes(params), pieces)
        local = take(nodes(workers), pieces)
        low = jnp.bfloat16 if self.config.bf16_pseudo_gradients else None

        def pseudo_gradient(s, w):
            delta = _array(s)[None] - w.array
            if low is not None:
                delta = delta.astype(low)  # the sum below, the all-reduce, stays in bfloat16
            total = jax.lax.reduce(delta, np.array(0, delta.dtype), jax.lax.add, (0,))
            return _like(s, total.astype(_array(s).dtype) / self.num_workers)

        grads = [pseudo_gradient(s, w) for s, w in zip(shared, local, strict=True)]
        updates, outer_state = self.outer.update(grads, outer_state, shared)
        new = optax.apply_updates(shared, updates)
        copies = [
            hax.NamedArray(jnp.broadcast_to(_array(n), w.array.shape), w.axes)
            for n, w in zip(new, local, strict=True)
        ]
        params = jax.tree.unflatten(
            jax.tree.structure(params, is_leaf=hax.is_named_array),
            put(nodes(params), pieces, new),
        )
        workers = jax.tree.unflatten(
            jax.tree.structure(workers, is_leaf=hax.is_named_array),
            put(nodes(workers), pieces, copies),
        )
        return params, workers, outer_state, global_norm(grads)


def _array(x: Any) -> jax.Array:
    return x.array if hax.is_named_array(x) else x


def _like(x: Any, array: jax.Array) -> Any:
    return hax.NamedArray(array, x.axes) if hax.is_named_array(x) else array


def worker_compute_mapping(compute: dict, batch_axis: str) -> dict:
    """The compute mapping inside one worker: ``batch_axis`` split over its axes but ``replica``."""
    targets = compute.get(batch_axis)
    targets = targets if isinstance(targets, tuple) else (targets,) if targets else ()
    kept = tuple(t for t in targets if t != "replica")
    inner = {k: v for k, v in compute.items() if k != batch_axis}
    if kept:
        inner[batch_axis] = kept if len(kept) > 1 else kept[0]
    return inner
