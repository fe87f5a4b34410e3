"""Hook settings: ``HookConfig`` (a ``trainer.hooks`` entry), ``hook_type`` and ``HookContext``.

A hook is declared once: a ``Hook`` subclass with a nested frozen ``Config`` dataclass,
registered by ``@hook_type("name")``. The config holds (and validates, once, in its
``__post_init__``) every setting; the hook reads them from ``self.config``. The same
registry builds the run's default hooks and those listed in YAML
(``trainer.hooks: [{type: divergence, patience: 3}]``). A hook of the user's own is named
in YAML by its module and class (``type: my_hooks:PrintLr``): the module is imported when
the config is parsed, and the class needs no registration.
"""

from __future__ import annotations

import abc
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import draccus

from loomax.config import ConfigError

if TYPE_CHECKING:
    from loomax.runtime import MeshRuntime


@dataclass
class HookContext:
    """What a run offers hooks when it builds them (everything optional but ``runtime``)."""

    runtime: MeshRuntime
    """The mesh and axis mappings (``jit``, ``shard_batch``, ``mesh_context``)."""
    trainer_config: Any = None
    """The ``trainer`` section, a ``TrainerConfig`` (num_train_steps, policy, batch_schedule...);
    not named in the annotation, since that module imports this one."""
    run_dir: Path | None = None
    """The run directory (hooks write their files under it)."""
    model_config: Any = None
    """The ``model`` section (seq_len, flops_per_token)."""
    vocab_size: int | None = None
    """The model's vocabulary size."""
    tokenizer: Any = None
    """The run's HF ``tokenizers.Tokenizer`` (text generation, bits per byte)."""
    validation: dict[str, list[Any]] = field(default_factory=dict)
    """Validation sets by name: lists of this process's rows of each eval batch."""
    loss_fn: Any = None
    """``loss_fn(model, batch, *, key) -> (loss_sum, weight)`` of evaluation (or ``((loss_sum, weight), metrics)``)."""
    evaluator: Callable[[Any], dict[str, float]] | None = None
    """The run's evaluator (``model -> {eval/loss, ...}``), built once and shared by eval hooks."""
    tokens_per_step: Any = 0
    """Tokens per optimizer step (all processes): an int, or ``tokens(step)`` = tokens trained on in steps 1..step."""
    flops_per_token: float | None = None
    """Training FLOPs per token (forward and backward)."""
    peak_flops: float | None = None
    """Peak FLOP/s of all devices together, if known."""
    config_yaml: str | None = None
    """The whole resolved run config as YAML."""
    primary: bool = True
    """Whether this is process 0 (the one that prints and writes shared files)."""
    trace_step: Callable[..., Any] | None = None
    """``trace_step(state, global_batch)``: the run's jitted step traced (``Trainer.trace_step``)."""
    write_artifact: Callable[..., Any] | None = None
    """``write_artifact(name, obj, type=...)``: a file of the run, logged to the tracker (process 0)."""


@dataclass(frozen=True)
class HookConfig(draccus.ChoiceRegistry, abc.ABC):
    """Settings of one hook; in YAML, ``type`` picks the hook (see ``hook_type``)."""

    hook_class: ClassVar[Any] = None
    """The ``Hook`` subclass these settings build (set by ``hook_type``)."""

    def build(self, context: HookContext) -> Any:
        """The hook (or hooks) these settings describe, given what the run knows."""
        if self.hook_class is None:
            raise TypeError(f"{type(self).__name__} is not registered with @hook_type")
        return self.hook_class.from_config(self, context)

    @classmethod
    def get_choice_class(cls, name: str) -> Any:
        """The settings class of hook type ``name``: a registered name, or a hook from the
        user's own module, ``module.path:HookClass`` (imported now, registered under that
        name; the module is looked for on ``sys.path``, then in the current directory)."""
        if name not in cls._choice_registry and ":" in name:
            hook = import_hook(name)
            config_cls = hook.__dict__.get("Config")
            if config_cls is None or not issubclass(config_cls, HookConfig):
                raise ConfigError(
                    f"trainer.hooks: type {name!r}: {hook.__name__} needs a nested "
                    "Config(HookConfig) dataclass (docs/hooks.md, a hook of your own)"
                )
            if config_cls.hook_class is None:  # not registered by @hook_type yet
                hook_type(name)(hook)
            else:  # registered under its own name too: found by both
                cls._choice_registry[name] = config_cls
        return super().get_choice_class(name)

    @classmethod
    def type_name(cls) -> str:
        """The ``type`` this config is registered under."""
        return cls.get_choice_name(cls)

    def check(self, ok: bool, message: str) -> None:
        """Raise ``ValueError`` naming ``trainer.hooks (type)`` unless ``ok``."""
        if not ok:
            raise ValueError(f"trainer.hooks ({self.type_name()}): {message}")

    def check_positive(self, *names: str) -> None:
        """Raise ``ValueError`` naming the hook type and field if a field is set and not > 0."""
        for name in names:
            value = getattr(self, name)
            self.check(value is None or value > 0, f"{name} must be > 0, got {value}")


def import_hook(path: str) -> type:
    """The class ``HookClass`` of ``module.path:HookClass``, its module imported from
    ``sys.path`` or else from the current directory; ``ConfigError`` naming what is missing."""
    module_name, _, class_name = path.partition(":")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name.split(".")[0] or os.getcwd() in sys.path:
                raise
            sys.path.append(os.getcwd())  # `loomax` itself is not run from here
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"trainer.hooks: type {path!r}: cannot import module {module_name!r} ({e}); "
            "put it on PYTHONPATH or in the current directory"
        ) from e
    hook = getattr(module, class_name, None)
    if not isinstance(hook, type):
        raise ConfigError(
            f"trainer.hooks: type {path!r}: module {module_name!r} ({module.__file__}) has no "
            f"class {class_name!r}"
        )
    return hook


def hook_type(name: str) -> Callable[[type], type]:
    """Class decorator: register the hook's nested ``Config`` as ``trainer.hooks`` type ``name``."""

    def register(cls: type) -> type:
        config_cls = cls.__dict__.get("Config")
        if config_cls is None or not issubclass(config_cls, HookConfig):
            raise TypeError(
                f"@hook_type({name!r}): {cls.__name__} needs a nested Config(HookConfig)"
            )
        HookConfig.register_subclass(name)(config_cls)
        config_cls.hook_class = cls
        return cls

    return register
