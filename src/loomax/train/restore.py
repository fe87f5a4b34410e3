"""Where a run's state comes from: a checkpoint to resume, other weights, or a fresh init.

The policy, in order: ``trainer.load_checkpoint`` decides whether a checkpoint is resumed
(from ``load_checkpoint_path`` or the checkpointer's ``base_path``); without one,
``trainer.initialize_from`` may supply the model weights, or else ``initial_weights()``
(e.g. a Hugging Face checkpoint's, read only when the run does not resume), each with a
fresh optimizer at step 0; otherwise the state is fresh. A fresh state is made inside a
jit whose outputs are already sharded by the parameter mapping, so the whole model never
exists on one device or host; loaded arrays are read straight into that sharding,
whatever the mesh that saved them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from loomax._jax_compat import installed_version
from loomax.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointInfo,
    list_checkpoints,
    load_latest,
)
from loomax.errors import MissingFileError, UserError
from loomax.models.lora.config import ADAPTER_LEAVES
from loomax.models.lora.linear import adapter_layers
from loomax.runtime import MeshRuntime
from loomax.storage import to_url
from loomax.train.config import TrainerConfig
from loomax.train.state import TrainerState, state_shardings
from loomax.train.step import StateExtra, trainable_params

logger = logging.getLogger(__name__)


def _cpu_init_compiler_options() -> dict[str, Any]:
    options: dict[str, Any] = {"xla_backend_optimization_level": 1}
    if installed_version("jaxlib") < (0, 11):
        options["xla_cpu_use_fusion_emitters"] = False  # jaxlib 0.11's XLA dropped the option
    return options


CPU_INIT_COMPILER_OPTIONS: dict[str, Any] = _cpu_init_compiler_options()
"""XLA options for compiling a fresh state's init on XLA:CPU. The init runs once and is
mostly threefry (one per parameter), which XLA:CPU's default code generation compiles
slowly for no use: LLVM's level 1 pipeline and XLA's elemental fusion emitters compiled the
0.37M-parameter GPT-2's init in 0.60-0.66 s instead of 1.98 s (2-core Intel SPR), with values
bitwise equal to the default's (tested for one family of each set of layer types). Not for
the train step: the elemental emitters made its steps 15% slower (bench/cpu_flags.py); and
not level 0, which changes the values' last bits."""


def init_program(init: Callable, shardings: Any, runtime: MeshRuntime) -> Callable:
    """``init`` jitted to ``shardings``, compiled when first called: on XLA:CPU with
    `CPU_INIT_COMPILER_OPTIONS`, elsewhere as ``jax.jit`` compiles it."""
    jitted = jax.jit(init, out_shardings=shardings)
    if runtime.mesh.devices.flat[0].platform != "cpu":
        return jitted
    compiled = []

    def call(key: jax.Array) -> Any:
        if not compiled:
            compiled.append(jitted.lower(key).compile(compiler_options=CPU_INIT_COMPILER_OPTIONS))
        return compiled[0](key)

    return call


@dataclass
class Restored:
    """The state to train from, and what a resumed checkpoint carried besides it."""

    state: TrainerState
    checkpoint: CheckpointInfo | None = None
    """The checkpoint the run resumed from, if any."""
    hook_states: dict[str, Any] = field(default_factory=dict)
    """Hook states saved with that checkpoint, by hook key."""
    train_seconds: float = 0.0
    """Training time already spent before that checkpoint."""


class CheckpointOwnerError(UserError, ValueError):
    """The checkpoints in a shared ``base_path`` belong to another run."""


def check_checkpoint_owner(
    config: TrainerConfig, checkpoints: list[CheckpointInfo], run_id: str | None
) -> None:
    """Refuse to resume, without being told to, a run whose checkpoints are another run's.

    Applies to the run's own ``checkpointer.base_path`` when it is set (a location runs may
    share) and not made per-run by ``append_run_id_to_base_path``; a checkpoint from
    ``load_checkpoint_path`` is the user's explicit choice and always allowed.
    """
    ckpt = config.checkpointer
    if config.load_checkpoint_path or not ckpt.base_path or ckpt.append_run_id_to_base_path:
        return
    if not checkpoints or run_id is None:
        return
    newest = checkpoints[-1]
    if newest.run_id is None or newest.run_id == run_id:
        return
    raise CheckpointOwnerError(
        f"trainer.checkpointer.base_path {ckpt.base_path} holds checkpoints of another run "
        f"({newest.run_id}, newest step {newest.step}); this run is {run_id}. To continue that "
        f"run set trainer.run_id {newest.run_id}; to start from its state set "
        f"trainer.load_checkpoint_path {newest.directory}; for its weights only, "
        f"trainer.initialize_from; or keep runs apart with "
        f"trainer.checkpointer.append_run_id_to_base_path true (or another base_path)"
    )


def check_restore_sources(
    config: TrainerConfig, own_checkpoints: str, run_id: str | None = None
) -> bool:
    """Fail now, before data is built or a step compiled, when a checkpoint the policy
    above requires is missing, or belongs to another run (``check_checkpoint_owner``);
    returns whether the run will resume.

    ``own_checkpoints`` is the checkpointer's directory. ``trainer.initialize_from`` is
    checked only when the run will not resume (resuming wins and never reads it).
    """
    resume_path = config.load_checkpoint_path or own_checkpoints
    found = list_checkpoints(resume_path) if config.load_checkpoint is not False else []
    check_checkpoint_owner(config, found, run_id)
    resumes = bool(found)
    if config.load_checkpoint and not resumes:
        raise MissingFileError(
            f"trainer.load_checkpoint is true but there is no complete checkpoint at {resume_path}"
        )
    if not resumes and config.initialize_from is not None:
        if not list_checkpoints(config.initialize_from):
            raise MissingFileError(
                f"trainer.initialize_from: no complete checkpoint at {config.initialize_from}"
            )
    return resumes


@dataclass
class StateBuilder:
    """Makes a run's ``TrainerState`` on ``runtime``'s mesh, by the policy above."""

    config: TrainerConfig
    runtime: MeshRuntime
    optimizer: optax.GradientTransformation
    extras: Mapping[str, StateExtra]

    def restore(
        self,
        init_model: Callable[[jax.Array], eqx.Module],
        checkpointer: Checkpointer,
        initial_weights: Callable[[], eqx.Module] | None = None,
    ) -> Restored:
        """The state to train from (see the module docstring for the order of sources)."""
        policy = self.config.policy
        init = self._init_fn(init_model)
        key = jax.random.PRNGKey(self.config.seed)
        with self.runtime.mesh_context():
            shapes = jax.eval_shape(init, key)
            shardings = self._shardings(shapes)
            fresh = functools.partial(init_program(init, shardings, self.runtime), key)

            def start() -> TrainerState:  # the state of a run that resumes nothing
                if self.config.initialize_from is not None:
                    return self._initialize_from(shapes, shardings, fresh, key)
                if initial_weights is not None:  # no random init compiled, none allocated
                    model = policy.cast_to_param(initial_weights())
                    return self._start_from(key, model, shardings)
                return fresh()

            resumed = self._resume(checkpointer, shapes, shardings, fresh, start)
            if resumed is not None:
                return resumed
            return Restored(start())

    def abstract(self, init_model: Callable[[jax.Array], eqx.Module]) -> TrainerState:
        """The fresh state as ``jax.ShapeDtypeStruct``s carrying their shardings: the same
        ``init`` and placement as ``restore``, with nothing allocated (for ahead-of-time compiles)."""
        key = jax.random.PRNGKey(self.config.seed)
        with self.runtime.mesh_context():
            shapes = jax.eval_shape(self._init_fn(init_model), key)
        shardings = self._shardings(shapes)  # outside: the devices may be compile-only

        def place(sharding, node):  # node: a ShapeDtypeStruct, or a NamedArray holding one
            return jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), node
            )

        is_leaf = lambda x: x is None or isinstance(x, jax.sharding.Sharding)  # noqa: E731
        return jax.tree.map(place, shardings, shapes, is_leaf=is_leaf)

    @property
    def _offload(self) -> bool:
        return self.config.offload_optimizer_state or self.config.offload_params

    def _reading(self, shardings: TrainerState) -> TrainerState:
        """Where arrays are read to: device memory (then moved where they rest, if offloaded)."""
        if not self._offload:
            return shardings
        return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)

    def _shardings(self, shapes: TrainerState) -> TrainerState:
        return state_shardings(
            self.runtime,
            shapes,
            offload_optimizer_state=self.config.offload_optimizer_state,
            offload_params=self.config.offload_params,
        )

    def _init_fn(self, init_model: Callable[[jax.Array], eqx.Module]) -> Callable:
        policy = self.config.policy

        def init(key):
            model_key, train_key = jax.random.split(key)
            model = policy.cast_to_param(init_model(model_key))
            params = eqx.filter(model, eqx.is_inexact_array)
            opt_state = self.optimizer.init(trainable_params(model, self.config.freeze))
            extras = {name: extra.init(params) for name, extra in self.extras.items()}
            return TrainerState(jnp.zeros((), jnp.int32), model, opt_state, train_key, extras)

        return init

    def _resume(
        self, checkpointer: Checkpointer, shapes, shardings, fresh, start
    ) -> Restored | None:
        config = self.config
        own = checkpointer.directory.url
        checkpointer.adopt(list_checkpoints(own), None)
        if config.load_checkpoint is False:
            return None
        path = config.load_checkpoint_path or own
        check_checkpoint_owner(config, list_checkpoints(path), checkpointer.run_id)
        reading = self._reading(shardings)
        found = load_latest(path, shapes, reading, fall_back=config.load_checkpoint is None)
        if found is None:
            if config.load_checkpoint:
                raise MissingFileError(
                    f"trainer.load_checkpoint is true but there is no complete checkpoint at {path}"
                )
            if config.load_checkpoint_path:
                logger.warning("no complete checkpoint at %s: starting fresh", path)
            return None
        checkpoint, state, missing = found
        left_out = checkpoint.metadata.get("frozen_left_out", [])
        if left_out:  # frozen weights come back from where the run began
            logger.info(
                "%d frozen array(s) were left out of %s: taking them from the run's start",
                len(left_out),
                checkpoint,
            )
            state = _fill(state, start())
            missing = [name for name in missing if name not in set(left_out)]
        state = self._fill_missing(checkpoint, state, missing, fresh)
        if self._offload:
            state = jax.device_put(state, shardings)
        logger.info("resumed from %s (step %d)", checkpoint, checkpoint.step)
        if to_url(path) == own or checkpoint.directory.url.startswith(own + "/"):
            checkpointer.adopt([], checkpoint.step)  # this step is already on disk
        return Restored(
            state,
            checkpoint,
            checkpoint.metadata.get("hooks", {}),
            float(checkpoint.metadata.get("train_seconds", 0.0)),
        )

    def _initialize_from(self, shapes, shardings, fresh, key: jax.Array) -> TrainerState:
        path = self.config.initialize_from
        reading = self._reading(shardings)
        found = load_latest(path, shapes, reading, fall_back=False, prefix="model")
        if found is None:
            raise MissingFileError(f"trainer.initialize_from: no complete checkpoint at {path}")
        checkpoint, loaded, missing = found
        fresh_model = functools.cache(lambda: fresh().model)  # only for what the checkpoint lacks
        model, missing = _new_adapters(loaded.model, missing, fresh_model)
        model = self._fill_missing(checkpoint, model, missing, fresh_model)
        logger.info(
            "model weights from %s (step %d); optimizer fresh at step 0",
            checkpoint,
            checkpoint.step,
        )
        return self._start_from(key, model, shardings)

    def _start_from(self, key: jax.Array, model: eqx.Module, shardings) -> TrainerState:
        """A fresh state (step 0, the train key ``init`` splits from ``key``) with ``model``
        as its weights (placed by the parameter mapping), and the optimizer state and the
        hooks' extras (e.g. EMA weights) made anew from them: the random init is neither
        compiled nor run."""

        def place_and_derive(m):
            params = eqx.filter(m, eqx.is_inexact_array)
            extras = {name: extra.init(params) for name, extra in self.extras.items()}
            return m, self.optimizer.init(trainable_params(m, self.config.freeze)), extras

        out = (shardings.model, shardings.opt_state, shardings.extras)
        with self.runtime.mesh_context():
            model, opt_state, extras = jax.jit(place_and_derive, out_shardings=out)(model)
        _, train_key = jax.random.split(key)  # as init splits it
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
        return TrainerState(
            step, model, opt_state, jax.device_put(train_key, shardings.key), extras
        )

    def _fill_missing(self, checkpoint: CheckpointInfo, tree, missing: list[str], fresh):
        if not missing:
            return tree
        if not self.config.allow_partial_checkpoint:
            raise CheckpointError(
                f"checkpoint {checkpoint} lacks {len(missing)} array(s) of the state, e.g. "
                f"{', '.join(missing[:3])}; set trainer.allow_partial_checkpoint: true to start those fresh"
            )
        logger.warning(
            "checkpoint %s lacks %d array(s) (%s...): they keep their initial values",
            checkpoint,
            len(missing),
            ", ".join(missing[:3]),
        )
        return _fill(tree, fresh())


def _new_adapters(
    model: Any, missing: list[str], fresh: Callable[[], Any]
) -> tuple[Any, list[str]]:
    """``model`` with the LoRA adapters (``model.lora``) a base model's checkpoint lacks
    taken from ``fresh()`` (B = 0: the base's outputs), and the names still missing (refused,
    or started fresh too with ``trainer.allow_partial_checkpoint``, by ``_fill_missing``)."""
    new = [n for n, layer in adapter_layers(model).items() if layer.lora_a is None]
    if not new:
        return model, missing
    logger.info("%d LoRA adapter(s) start fresh (the checkpoint has none)", len(new))
    rest = [n for n in missing if n.rsplit("/", 1)[-1] not in ADAPTER_LEAVES]
    return _fill(model, fresh()), rest


def _fill(tree: Any, source: Any) -> Any:
    """``tree`` with its None leaves (arrays a checkpoint did not hold) taken from ``source``."""
    return jax.tree.map(
        lambda a, b: b if a is None else a, tree, source, is_leaf=lambda x: x is None
    )
