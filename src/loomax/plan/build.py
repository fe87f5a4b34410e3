"""Build a run's real train step for a set of devices, with abstract arrays only.

The step is the one ``loomax train`` runs: the same ``Trainer`` (over the given devices,
through the run's ``trainer.mesh`` and axis mappings), optimizer, loss, model init and the
hooks that change the step; the state comes from ``Trainer.abstract_state``
(``jax.eval_shape``: no parameter memory anywhere). Data, trackers, checkpoints and Ray
are not touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from loomax.config import ConfigError
from loomax.lm.config import TrainLmConfig, batch_shape
from loomax.lm.loss import lm_loss_for, model_lm_loss
from loomax.lm.weights import initial_model
from loomax.mesh import batch_sharding, context_spans_processes
from loomax.train import HookContext, Trainer, TrainerState

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BuiltStep:
    """A trainer over the target devices, its abstract state and batch, and build notes."""

    trainer: Trainer
    state: TrainerState
    batch: jax.ShapeDtypeStruct
    vocab_size: int
    notes: list[str]

    def trace(self) -> jax.stages.Traced:
        """The step traced for the abstract state and batch (``.lower().compile()`` it)."""
        return self.trainer.trace_step(self.state, self.batch)


def local_tokenizer(config: TrainLmConfig) -> Path | None:
    """The run's tokenizer.json if it is on this machine (a path, or a hub id in the Hugging Face
    cache; no download, no training); else None."""
    name = config.data.tokenizer
    if name is None:
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        return path
    try:  # a hub id already in the Hugging Face cache (looked up offline)
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "tokenizer.json")
    except Exception:  # noqa: BLE001 - not a valid hub id, or no huggingface_hub
        return None
    return Path(cached) if isinstance(cached, str) else None


KNOWN_VOCAB_SIZES = {
    "gpt2": 50257,
    "openai-community/gpt2": 50257,
    "meta-llama/Meta-Llama-3-8B": 128256,
    "meta-llama/Llama-3.1-8B": 128256,
    "meta-llama/Llama-3.2-1B": 128256,
    "meta-llama/Llama-2-7b-hf": 32000,
    "mistralai/Mistral-7B-v0.1": 32000,
}
"""Sizes (``tokenizer.get_vocab_size()``) of well-known hub tokenizers, so compiling a run that
names one needs neither a download nor ``model.vocab_size``."""


def vocab_size_of(config: TrainLmConfig) -> tuple[int, str | None]:
    """The model's vocabulary size, and a note when it was not ``model.vocab_size``.

    ``model.vocab_size``, else a local tokenizer's size, else a well-known hub tokenizer's
    (``KNOWN_VOCAB_SIZES``), else (no tokenizer configured) the BPE the run would train
    (``data.tokenizer_vocab_size``); otherwise a ``ConfigError``.
    """
    if config.model.vocab_size is not None:
        return config.model.vocab_size, None
    path = local_tokenizer(config)
    if path is not None:
        from loomax.data.tokenizer import load_tokenizer

        return load_tokenizer(path).get_vocab_size(), f"vocab size from {path}"
    known = KNOWN_VOCAB_SIZES.get(config.data.tokenizer or "")
    if known is not None:
        return known, f"vocab size {known}: the size of tokenizer {config.data.tokenizer!r}"
    if config.data.tokenizer is None:
        size = config.data.tokenizer_vocab_size
        return size, f"vocab size {size}: the BPE the run trains (data.tokenizer_vocab_size)"
    raise ConfigError(
        f"model.vocab_size is null and the tokenizer {config.data.tokenizer!r} is not a local file; "
        "pass --model.vocab_size N (compiling reads no data and downloads nothing)"
    )


def loss_of(config: TrainLmConfig) -> tuple[object, str | None]:
    """The run's training loss; with document masking and no local tokenizer, ``lm_loss`` with a
    stand-in EOS id (the same program: only the constant compared with tokens differs)."""
    model = config.model
    chat = config.data.format == "chat"  # documents from the rows' ids: no EOS needed
    if chat or not model.document_mask or local_tokenizer(config) is not None:
        return model_lm_loss(config), None
    return lm_loss_for(
        model, eos_id=0
    ), "document mask compiled with a stand-in EOS id (tokenizer not local)"


@contextlib.contextmanager
def built_step(config: TrainLmConfig, devices: Sequence[jax.Device]) -> Iterator[BuiltStep]:
    """The run's step over ``devices`` with abstract inputs; its scratch run dir is removed after."""
    vocab_size, vocab_note = vocab_size_of(config)
    loss_fn, loss_note = loss_of(config)
    notes = [n for n in (vocab_note, loss_note) if n]
    scratch = tempfile.mkdtemp(prefix="loomax-compile-")
    try:
        trainer_config = config.trainer.for_scratch_run(scratch)
        steps, batches = trainer_config.num_train_steps, trainer_config.batch_schedule
        trainer = Trainer(
            trainer_config,
            config.optimizer.build(steps, batches),
            loss_fn,
            run_id="compile",
            lr_schedule=config.optimizer.lr_scheduler(steps, batches),
            devices=devices,
            qk_clip_tau=config.optimizer.qk_clip_tau,
        )
        if context_spans_processes(trainer.mesh.devices):
            notes.append(SPANS_HOSTS_NOTE)
        notes += _add_hooks(trainer, config, vocab_size, loss_fn)
        state = trainer.abstract_state(initial_model(config, vocab_size))
        shape = batch_shape(config, batches.sizes[0])  # chat SFT: packed rows, 3 channels
        batch = jax.ShapeDtypeStruct(
            shape, jnp.int32, sharding=batch_sharding(trainer.mesh, len(shape))
        )
        yield BuiltStep(trainer, state, batch, vocab_size, notes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


SPANS_HOSTS_NOTE = (
    "a trainer.mesh.context group spans hosts (processes): compiled as the pod would run it; "
    "`loomax train` trains it, the hosts of a group loading the same rows of each batch"
)


def _add_hooks(trainer: Trainer, config: TrainLmConfig, vocab_size: int, loss_fn) -> list[str]:
    """Add the run's ``trainer.hooks`` (they may add state or jitted metrics to the step);
    one that needs the data or tokenizer to be built is left out, with a note."""
    context = HookContext(
        trainer.runtime,
        trainer_config=trainer.config,
        run_dir=trainer.run_dir,
        model_config=config.model,
        vocab_size=vocab_size,
        loss_fn=loss_fn,
        primary=False,
    )
    notes = []
    for hook_config in trainer.config.hooks:
        try:
            built = hook_config.build(context)
        except Exception as e:  # noqa: BLE001 - a hook that needs the data cannot change the step's shape
            notes.append(f"hook {hook_config.type_name()} left out ({type(e).__name__}: {e})")
            continue
        for hook in built if isinstance(built, list) else [built]:
            trainer.add_hook(hook)
    return notes
