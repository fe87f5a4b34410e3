"""The trainer's jitted step: built once per number of microbatches, traced, compiled, run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from loomax.config import ConfigError
from loomax.mesh import replicated
from loomax.train.diloco import DiLoCo, worker_compute_mapping
from loomax.train.state import TrainerState, state_shardings
from loomax.train.step import make_train_step

logger = logging.getLogger(__name__)

_UNSET: Any = object()


class JittedSteps:
    """The ``Trainer``'s step functions (a base class: it uses the trainer's ``loss_fn``,
    ``optimizer``, ``outer_optimizer``, ``config``, ``lr_schedule``, ``hook_set``,
    ``runtime``, ``num_microbatches`` and its caches ``_step_fns`` and ``_precompiled``).

    Under ``trainer.diloco`` a step is one of several programs: the inner step, or the inner
    step followed by the sync of fragment ``sync``; the loop picks it from the step number.
    """

    def diloco(self) -> DiLoCo | None:
        """The run's DiLoCo (over the optimizer as hooks left it), or None without ``trainer.diloco``."""
        if self.config.diloco is None:
            return None
        hooks = self.hook_set
        if hooks.jit_hooks or hooks.extras:
            raise ConfigError(
                "trainer.diloco: hooks that compute inside the step or keep arrays in the "
                f"state ({', '.join(h.name for h in hooks.hooks if h.jit_hooks() or h.state_extras())}) "
                "do not run under DiLoCo; remove them or trainer.diloco"
            )
        workers = self.runtime.mesh.shape["replica"]
        return DiLoCo(self.config.diloco, self.optimizer, workers, self.outer_optimizer)

    def trace_step(
        self,
        state: TrainerState,
        batch: Any,
        *,
        num_microbatches: int | None = None,
        sync: int | None = None,
    ) -> jax.stages.Traced:
        """The jitted step traced for ``state`` and a global ``batch`` (arrays, or
        ``ShapeDtypeStruct``s with shardings): ``.jaxpr``, ``.lower().compile()``. Under
        DiLoCo, ``sync`` picks the program (None: an inner step)."""
        step_fn = self._build_step(state, num_microbatches, sync)
        with self.runtime.mesh_context():
            return step_fn.jitted.trace(state, batch)

    def _build_step(
        self,
        state: TrainerState,
        num_microbatches: int | None = None,
        sync: int | None = None,
        activation_stats: bool = False,
    ) -> Callable:
        microbatches = num_microbatches or self.num_microbatches
        key = self._step_key(num_microbatches, sync, activation_stats)
        if key in self._step_fns:
            return self._step_fns[key]
        diloco = self.diloco()
        mesh = self.runtime.mesh
        if diloco is not None:
            if activation_stats:
                raise ConfigError("activation statistics are not taken under trainer.diloco")
            if self.qk_clip_tau is not None:
                raise ConfigError("optimizer.qk_clip_tau is not supported under trainer.diloco")
            step = diloco.make_step(
                self.loss_fn,
                mp=self.config.policy,
                compute_mapping=worker_compute_mapping(
                    self.runtime.mappings.compute, self.config.batch_axis
                ),
                num_microbatches=microbatches,
                lr_schedule=self.lr_schedule,
                freeze=self.config.freeze,
                sync=sync,
            )
            metrics = NamedSharding(mesh, PartitionSpec("replica"))  # one value per worker
        else:
            if self.config.offload_optimizer_update and mesh.devices.flat[0].platform == "gpu":
                raise ConfigError(
                    "trainer.offload_optimizer_update: XLA's GPU compiler cannot build an update "
                    "on the host (it fails in layout assignment); on GPUs use "
                    "trainer.offload_optimizer_state alone"
                )
            mappings = self.runtime.mappings
            step = make_train_step(
                self.loss_fn,
                self.optimizer,
                mp=self.config.policy,
                num_microbatches=microbatches,
                lr_schedule=self.lr_schedule,
                jit_hooks=self.hook_set.jit_hooks,
                extras=self.hook_set.extras,
                freeze=self.config.freeze,
                grad_mapping=mappings.optimizer if mappings.zero2 else None,
                offload_optimizer_state=self.config.offload_optimizer_state,
                update_on_host=self.config.offload_optimizer_update,
                offload_params=self.config.offload_params,
                activation_stats=activation_stats,
                qk_clip_tau=self.qk_clip_tau,
            )
            metrics = replicated(mesh)
        shardings = state_shardings(
            self.runtime,
            state,
            offload_optimizer_state=self.config.offload_optimizer_state,
            offload_params=self.config.offload_params,
        )
        out = (shardings, metrics)
        self._step_fns[key] = self.runtime.jit(step, out_shardings=out, donate_argnums=0)
        return self._step_fns[key]

    def train_step(
        self,
        state: TrainerState,
        batch: Any,
        *,
        num_microbatches: int | None = None,
        sync: int | None = _UNSET,
        activation_stats: bool = False,
    ) -> tuple[TrainerState, dict[str, jax.Array]]:
        """Run the jitted pure step (compiled on first use); ``state`` is donated.

        ``batch`` is this process's rows (numpy) or an already global ``jax.Array``.
        ``num_microbatches`` defaults to that of the first batch size. Under DiLoCo ``sync``
        (the fragment this step syncs, or None) defaults to what ``state.step`` implies
        (read from the device: the loop passes it instead). ``activation_stats`` runs the
        variant that also returns activation statistics (compiled on its first use).
        """
        if sync is _UNSET:
            sync = self.config.diloco and self.config.diloco.synced_at(int(state.step) + 1)
        step_fn = self._build_step(state, num_microbatches, sync, activation_stats)
        if not isinstance(batch, jax.Array):
            batch = self.place_batch(batch)
        key = self._step_key(num_microbatches, sync, activation_stats)
        compiled, shapes = self._precompiled.get(key, (None, None))
        if compiled is not None and _shapes(batch) == shapes:  # not a warm-up's shorter batch
            try:  # the program compiled ahead of time (precompile): no second compile
                return compiled(state, batch)
            except (TypeError, ValueError) as e:  # another state layout, found before it runs
                del self._precompiled[key]
                logger.info(
                    "the step compiled ahead of time does not take this state (%s); "
                    "compiling it for it",
                    str(e).splitlines()[0][:200],
                )
        return step_fn(state, batch)

    def precompile(self, state: TrainerState, batch: Any, **step_args: Any):
        """Compile the step for ``state`` and a global ``batch`` (``ShapeDtypeStruct``s with
        shardings will do) now, ahead of the first step, which then runs this program; the
        ``jax.stages.Compiled`` it returns has the step's ``memory_analysis()``."""
        num_microbatches = step_args.get("num_microbatches")
        sync, stats = step_args.get("sync"), step_args.get("activation_stats", False)
        step_fn = self._build_step(state, num_microbatches, sync, stats)
        with self.runtime.mesh_context():
            compiled = step_fn.jitted.lower(state, batch).compile()
        self._precompiled[self._step_key(num_microbatches, sync, stats)] = (
            compiled,
            _shapes(batch),
        )
        return compiled

    def _step_key(self, num_microbatches, sync, activation_stats) -> tuple:
        return (num_microbatches or self.num_microbatches, sync, activation_stats)

    def place_batch(self, batch: Any) -> Any:
        """This process's rows as a global batch, split over (replica, data); a batch that
        does not split evenly (``trainer.allow_nondivisible_batch_size``) goes whole to
        every device (the step's compute mapping still splits its work, unevenly)."""
        rows = jax.tree.leaves(batch)[0].shape[0]
        if self.config.allow_nondivisible_batch_size and rows % self.runtime.data_parallel_size:
            return jax.device_put(batch, replicated(self.runtime.mesh))
        return self.runtime.shard_batch(batch)

    def compiled_step(self, state: TrainerState, batch: Any, *, sync: int | None = None):
        """The step compiled ahead of time for these shapes; call it with ``place_batch(batch)``."""
        step_fn = self._build_step(state, sync=sync)
        with self.runtime.mesh_context():
            return step_fn.jitted.lower(state, self.place_batch(batch)).compile()

    def compilations(self) -> int:
        """How many step variants have been compiled (one per shape and batch size)."""
        jitted = sum(fn.jitted._cache_size() for fn in self._step_fns.values())
        return jitted + len(self._precompiled)


def _shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shapes of a batch's arrays (what a precompiled step is matched on first)."""
    return [tuple(x.shape) for x in jax.tree.leaves(batch)]
