"""Load a trained model for export, generation and evaluation, from any of its three forms.

``--checkpoint PATH`` may be a ``model.save`` directory (``model.yaml``), a Hugging Face
directory (``config.json``), or a trainer checkpoint (``step-N`` or a directory of them,
the latest complete wins) whose run config is ``config.yaml`` in the run directory above
it (or ``--config_path``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from loomax.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from loomax.cli_parser import given_values
from loomax.config import ConfigError, parse_config
from loomax.errors import MissingFileError
from loomax.lm import TrainLmConfig, hf_type_args, resolve_vocab_size
from loomax.models.config import LmModel
from loomax.models.lora.linear import apply_lora, merge_lora
from loomax.tree_paths import is_named_array


@dataclass
class LoadedModel:
    """A model and what came with it."""

    model: LmModel
    run_config: TrainLmConfig | None
    """The run's config (trainer checkpoints, or when ``--config_path`` is given)."""
    tokenizer: Path | None
    """tokenizer.json to encode prompts and decode samples, when known."""
    description: str


def find_run_config(path: Path) -> Path | None:
    """``config.yaml`` of the run a checkpoint belongs to: in the checkpoint's parents."""
    for parent in [path, *path.resolve().parents][:4]:
        if (parent / "config.yaml").is_file():
            return parent / "config.yaml"
    return None


def load_for_inference(
    checkpoint: str | Path,
    *,
    config_path: str | None = None,
    overrides: list[str] = (),
    merge_adapters: bool = True,
) -> LoadedModel:
    """The model at ``checkpoint`` (see the module docstring), in float32 on one device; a
    LoRA run's trainer checkpoint with its adapters merged (kept apart: ``merge_adapters``
    false)."""
    path = Path(checkpoint)
    run_config, given, hf_dir = None, {}, (path / "config.json").is_file()
    if config_path is not None or overrides:
        given = given_values(TrainLmConfig, config_path, list(overrides))
        type_args = hf_type_args(str(path), given) if hf_dir else []  # config.json's family
        run_config = parse_config(TrainLmConfig, config_path, type_args + list(overrides))
    if (path / "model.yaml").is_file():  # a model.save directory (its tokenizer if saved with it)
        from loomax.models.io.saving import load_model

        tokenizer = _beside_or_run_tokenizer(path, run_config)
        return LoadedModel(load_model(path), run_config, tokenizer, f"saved model {path}")
    if hf_dir:  # the model of config.json, the run's model keys winning
        from loomax.hf import hf_model_config, load_hf

        own = [k[1:] for k in given if k[0] == "model" and len(k) > 1]
        model_config = hf_model_config(path, run_config and run_config.model, own)
        if run_config is not None:
            run_config = replace(run_config, model=model_config)
        tokenizer = _beside_or_run_tokenizer(path, run_config)
        model = load_hf(path, model_config)
        return LoadedModel(model, run_config, tokenizer, f"Hugging Face checkpoint {path}")
    if not path.exists():
        raise MissingFileError(f"--checkpoint {path} does not exist")
    if run_config is None:
        found = find_run_config(path)
        if found is None:
            raise MissingFileError(
                f"--checkpoint {path}: no model.yaml, config.json, or run config.yaml above it; pass --config_path"
            )
        run_config = parse_config(TrainLmConfig, str(found), [])
    checkpoints = list_checkpoints(str(path))
    if not checkpoints:
        raise MissingFileError(
            f"--checkpoint {path}: no complete checkpoint (step-N with metadata.json)"
        )
    tokenizer = _run_tokenizer(run_config)
    from loomax.data.tokenizer import load_tokenizer

    vocab = resolve_vocab_size(run_config.model, load_tokenizer(tokenizer).get_vocab_size())
    model = _read_model(checkpoints[-1], run_config, vocab, merge=merge_adapters)
    return LoadedModel(model, run_config, tokenizer, f"checkpoint {checkpoints[-1]}")


def _beside_or_run_tokenizer(path: Path, run_config: TrainLmConfig | None) -> Path | None:
    """The tokenizer.json saved in the model's directory, else the run's (if known)."""
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    return _run_tokenizer(run_config) if run_config is not None else None


def _run_tokenizer(config: TrainLmConfig) -> Path:
    from loomax.data.run_tokenizer import prepare_tokenizer

    return Path(prepare_tokenizer(config.data))


def _read_model(checkpoint, config: TrainLmConfig, vocab: int, *, merge: bool = True) -> LmModel:
    """The checkpoint's model in float32 on one device; a LoRA run's (``model.lora``) with its
    adapters, merged into the weights unless ``merge`` is false."""
    lora = config.model.lora

    def build():
        model = config.model.build(vocab, key=jax.random.PRNGKey(0))
        return model if lora is None else apply_lora(model, lora)

    skeleton = jax.eval_shape(build)
    template = {"model": skeleton}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, template, is_leaf=is_named_array)
    tree, missing = load_checkpoint(checkpoint, template, shardings, prefix="model")
    if missing:
        raise CheckpointError(
            f"checkpoint {checkpoint} lacks {len(missing)} model array(s), e.g. {missing[:3]}: "
            "does the run config match the checkpoint?"
        )
    model = jax.tree.map(lambda x: x.astype(jnp.float32), tree["model"])
    return merge_lora(model) if lora is not None and merge else model


def validation_sets(
    config: TrainLmConfig, batch_size: int | None, max_batches: int | None
) -> dict[str, list[np.ndarray]]:
    """Validation batches per set, named as the in-loop eval names them (one set per
    ``data.validation`` source, or per train source's held-out documents); caches are built
    if missing."""
    from loomax.data import build_lm_datasets
    from loomax.lm import eval_sets

    trainer = replace(
        config.trainer,
        eval_batch_size=batch_size or config.trainer.eval_batch_size,
        max_eval_batches=max_batches or config.trainer.max_eval_batches,
    )
    if config.data.format == "chat":  # held-out conversations, packed as the run packed them
        from loomax.data.chat.dataset import build_chat_datasets

        data = build_chat_datasets(config.data, config.model.seq_len)
    else:
        data = build_lm_datasets(config.data, config.model.seq_len, ray=trainer.ray)
    sets = eval_sets(replace(config, trainer=trainer), data, 1)
    return sets if isinstance(sets, dict) else {"validation": sets}


def evaluate(
    loaded: LoadedModel, *, batch_size: int | None = None, max_batches: int | None = None
) -> dict[str, float]:
    """Loss, perplexity and bits per byte per validation set (``eval/<set>/...``) and their
    macro averages (``eval/loss``, ...), with the run's loss settings."""
    from loomax.data.tokenizer import load_tokenizer
    from loomax.hooks.eval import make_loss_evaluator, next_token_bytes, token_byte_lengths
    from loomax.lm import model_lm_loss

    config = loaded.run_config
    if config is None:
        raise ConfigError(
            "evaluation needs the run config (its data.validation): pass --config_path"
        )
    if loaded.model.config.seq_len != config.model.seq_len:
        config = replace(config, model=replace(config.model, seq_len=loaded.model.config.seq_len))
    sets = validation_sets(config, batch_size, max_batches)
    tokenizer = load_tokenizer(_run_tokenizer(config))
    count_bytes = next_token_bytes(token_byte_lengths(tokenizer, loaded.model.Vocab.size))
    if config.data.format == "chat":  # the loss covers masked tokens only: no bytes per token
        count_bytes = None
    evaluator = make_loss_evaluator(
        model_lm_loss(config, training=False), sets, config.trainer.policy, count_bytes=count_bytes
    )
    return evaluator(loaded.model)
