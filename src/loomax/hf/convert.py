"""Write a model as a Hugging Face checkpoint directory, and read one back.

The directory holds ``config.json``, ``model.safetensors`` (or ``model-0000i-of-0000n``
shards plus ``model.safetensors.index.json`` above ``max_shard_bytes``) and, when given,
the tokenizer files: what ``transformers``' ``from_pretrained`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from loomax.data.tokenizer import bos_id, eos_id
from loomax.errors import BadFileError, MissingFileError
from loomax.hf.config_json import check_same_architecture, describe, model_from_hf, written_config
from loomax.hf.family import family_of
from loomax.models.config import LmConfig, LmModel
from loomax.models.io.hf_layout import export_tensors, load_tensors

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}


def hf_state(
    model: LmModel, special_tokens: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, np.ndarray], list[str]]:
    """``(config.json dict, {HF tensor name: array}, the fields changed)`` of ``model``: the
    config.json it was imported from, changed only where training changed it
    (``loomax.hf.config_json.written_config``), else its family's own."""
    family = family_of(model.config)
    family.hf_config(model.Vocab.size)  # an option transformers lacks: refused before any work
    tensors = export_tensors(model, family.hf_params())
    dtype = next(iter(tensors.values())).dtype
    written = {"torch_dtype": _DTYPE_NAMES.get(dtype, "bfloat16"), **(special_tokens or {})}
    config, changed = written_config(model.config, model.Vocab.size, written)
    return config, tensors, changed


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """config.json's ``bos_token_id``/``eos_token_id`` for a ``tokenizers.Tokenizer``: its
    end-of-document token, and its beginning-of-document token or else the EOS again (as
    GPT-2: documents start after an EOS)."""
    eos = eos_id(tokenizer)
    try:
        bos = bos_id(tokenizer)
    except ValueError:
        bos = eos
    return {"bos_token_id": bos, "eos_token_id": eos}


def export_hf(
    model: LmModel,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | Any = None,
    special_tokens: dict[str, int] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    chat_template: str | None = None,
) -> Path:
    """Write ``model`` to ``out_dir`` in the Hugging Face layout; returns the directory.

    ``tokenizer`` (a tokenizer.json path, or a ``tokenizers.Tokenizer``) is written alongside; ``special_tokens`` (e.g.
    ``{"bos_token_id": 0, "eos_token_id": 0}``) go into config.json; a missing BOS is the
    EOS, and with neither both are written as null, so that transformers does not assume
    its own defaults (GPT-2's 50256, Llama's 1 and 2), which need not exist in this vocabulary.
    ``chat_template`` (Jinja source) goes into tokenizer_config.json, where transformers'
    ``apply_chat_template`` reads it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config, tensors, changed = hf_state(model, special_tokens)
    config.setdefault("eos_token_id", None)
    config.setdefault("bos_token_id", config["eos_token_id"])
    if model.config.hf_config_json:
        logger.info(
            "%s/config.json: the imported fields, changed: %s", out, ", ".join(changed) or "none"
        )
    _write_shards(out, tensors, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        if hasattr(tokenizer, "save"):  # a tokenizers.Tokenizer
            tokenizer.save(str(out / "tokenizer.json"))
        else:
            shutil.copyfile(tokenizer, out / "tokenizer.json")
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model.config.seq_len,
            **_special_token_names(out / "tokenizer.json", config),
        }
        if chat_template is not None:
            tok_config["chat_template"] = chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


def _write_shards(out: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> None:
    for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(array)
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _hf_files(path: Path) -> tuple[dict[str, Any], list[str]]:
    """``(config.json dict, safetensors file names)`` of a checkpoint directory, unread weights."""
    if not (path / "config.json").is_file():
        raise MissingFileError(f"{path} is not a Hugging Face checkpoint: no config.json")
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise BadFileError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    if (path / INDEX_FILE).is_file():
        files = sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise MissingFileError(
            f"{path}: no model.safetensors or {INDEX_FILE} (only safetensors are read)"
        )
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        raise MissingFileError(f"{path}: weight files missing: {', '.join(missing)}")
    return config, files


def read_hf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config.json dict, tensors)`` of a Hugging Face checkpoint directory."""
    path = Path(path)
    config, files = _hf_files(path)
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(load_file(str(path / name)))
    return config, tensors


def check_hf(path: str | os.PathLike, config: LmConfig) -> None:
    """Raise now, reading no weights, if ``load_hf(path, config)`` cannot work: no
    config.json, weight files missing, an unsupported model type or another architecture."""
    hf, _ = _hf_files(Path(path))
    arch, _ = config_from_hf(hf)
    check_same_architecture(config, arch, path)


def config_from_hf(hf: dict[str, Any]) -> tuple[LmConfig, int]:
    """``(model config, vocab size)`` for a config.json dict (which the config keeps, for
    export to write back)."""
    return model_from_hf(hf), hf["vocab_size"]


def hf_model_config(
    path: str | os.PathLike,
    configured: LmConfig | None = None,
    given: Any = (),
) -> LmConfig:
    """The ``model`` section of a run that starts from the checkpoint at ``path``, reading no
    weights: config.json's family, architecture and vocabulary, with the keys the run gave itself
    (``given``: key paths inside ``model``, e.g. ``("attn_backend",)``) taken from
    ``configured`` (``loomax.hf.config_json.model_from_hf``); logs one line of what was read."""
    hf, _ = _hf_files(Path(path))
    given = [tuple(p) for p in given]
    config = model_from_hf(hf, configured, given, path)
    if config.vocab_size is None:  # the checkpoint's vocabulary (a smaller tokenizer fits it)
        config = dataclasses.replace(config, vocab_size=hf.get("vocab_size"))
    logger.info("model from %s: %s", Path(path) / "config.json", describe(config, given))
    return config


def load_hf(path: str | os.PathLike, config: LmConfig | None = None) -> LmModel:
    """The model stored in a Hugging Face checkpoint directory.

    ``config`` (the run's ``model`` section) keeps its training-only settings (attention
    backend, remat, loss blocks); the architecture fields must match config.json.
    """
    hf, tensors = read_hf(path)
    arch, vocab = config_from_hf(hf)
    if config is not None:
        check_same_architecture(config, arch, path)
        arch = config if config.hf_config_json else dataclasses.replace(config, hf_config_json=hf)
    skeleton = jax.eval_shape(lambda: arch.build(vocab, key=jax.random.PRNGKey(0)))
    return load_tensors(skeleton, family_of(arch).hf_params(), tensors)


def _special_token_names(tokenizer_json: Path, config: dict[str, Any]) -> dict[str, str]:
    """tokenizer_config.json's ``bos_token``/``eos_token``: the strings of config.json's ids, so
    that a transformers tokenizer (and what reads it, e.g. lm-eval's ``hf`` backend) knows them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    names = {}
    for key in ("bos", "eos"):
        token_id = config.get(f"{key}_token_id")
        token = tokenizer.id_to_token(token_id) if token_id is not None else None
        if token is not None:
            names[f"{key}_token"] = token
    return names
