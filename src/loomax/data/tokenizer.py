"""Tokenizers: train a byte-level BPE, load a tokenizer.json, and encode documents.

Byte-level BPE can encode any text without an unknown token, so a small model trained on
one corpus can still be sampled and evaluated on any other.
"""

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loomax.atomic_files import replace_path
from loomax.errors import BadFileError, DataSourceError, MissingFileError

if TYPE_CHECKING:
    from loomax.data.fast_encoder import FastEncoder

EOS_TOKEN = "<|endoftext|>"
"""End-of-document token of the tokenizers trained here (id 0)."""

EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>")
"""Tokens `eos_id` accepts as end-of-document, in order of preference."""

MIN_VOCAB_SIZE = 260
"""Smallest vocabulary `train_bpe_tokenizer` accepts: 256 bytes, EOS and a few merges."""

ENCODE_CHUNK = 512
"""Documents per `encode_batch` call: large enough to use every core, small enough to bound memory."""

_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def train_bpe_tokenizer(
    documents: Iterable[str], vocab_size: int, out_path: str | Path
) -> Tokenizer:
    """Trains a byte-level BPE tokenizer on `documents` and saves it to `out_path`.

    The tokenizer splits text with GPT-2's byte-level pre-tokenizer (no prefix space),
    decodes back to the exact text, and has `EOS_TOKEN` as id 0. The file is written
    atomically, so a reader never sees a partial tokenizer.json.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"tokenizer vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    replace_path(out_path, lambda tmp: tokenizer.save(str(tmp)))
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads a tokenizer from a tokenizer.json file (or a folder holding one).

    Raises like `resolve_tokenizer_path` if there is no such file, and `BadFileError`
    naming the file if it is not a tokenizer (truncated, overwritten, another format).
    """
    file = resolve_tokenizer_path(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises plain Exception
        raise BadFileError(
            f"tokenizer: {file} is not a readable tokenizer.json ({' '.join(str(error).split())}); "
            "replace it with a good copy, or leave `data.tokenizer` out to train a BPE"
        ) from error


def resolve_tokenizer_path(path: str | Path) -> Path:
    """The tokenizer.json file that `path` names: the path itself, the one in that folder,
    or, for a Hugging Face hub id like `gpt2` or `org/model`, its tokenizer.json fetched
    into (or found in, when offline) the HF cache.

    Raises FileNotFoundError naming the path if it looks like a path but is missing, and
    ValueError naming the id if a hub id cannot be fetched.
    """
    path_str = str(path)
    given = Path(path_str).expanduser()
    file = given / "tokenizer.json" if given.is_dir() else given
    if file.is_file():
        return file
    if given.exists() or _looks_like_path(path_str):
        raise MissingFileError(f"tokenizer file not found: {file}")
    return _from_hub(path_str)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, "tokenizer.json"))
    except Exception as error:  # noqa: BLE001 - many network and hub error types
        raise DataSourceError(
            f"tokenizer {repo_id!r} is not a local path, and fetching it from the Hugging Face hub "
            f"failed (hub ids need network, or the file in the HF cache): {error}"
        ) from error


def _looks_like_path(name: str) -> bool:
    """Whether `name` can only be a file path, not a hub id like `gpt2` or `org/model`."""
    return name.startswith((".", "~", "/")) or name.endswith(".json") or not _HUB_ID.match(name)


BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
"""Tokens `bos_id` accepts as beginning-of-document, in order of preference."""


def _first_id(tokenizer: Tokenizer, candidates: Sequence[str]) -> int | None:
    ids = (tokenizer.token_to_id(token) for token in candidates)
    return next((i for i in ids if i is not None), None)


def bos_id(tokenizer: Tokenizer) -> int:
    """Id of the tokenizer's beginning-of-document token (one of `BOS_CANDIDATES`)."""
    found = _first_id(tokenizer, BOS_CANDIDATES)
    if found is None:
        raise DataSourceError(
            "data.bos is true but the tokenizer has no beginning-of-document token; looked for "
            f"{', '.join(BOS_CANDIDATES)}"
        )
    return found


def eos_id(tokenizer: Tokenizer) -> int:
    """Id of the tokenizer's end-of-document token (one of `EOS_CANDIDATES`)."""
    found = _first_id(tokenizer, EOS_CANDIDATES)
    if found is None:
        raise DataSourceError(
            f"tokenizer has no end-of-document token; looked for {', '.join(EOS_CANDIDATES)}"
        )
    return found


def encode_documents(
    tokenizer: Tokenizer,
    documents: Sequence[str],
    append_eos: bool = True,
    fast: "FastEncoder | None" = None,
) -> list[np.ndarray]:
    """Token ids of each document as int32 arrays, each followed by EOS if `append_eos`.

    Uses the tokenizer's multi-threaded batch encoding (`encode_batch_fast`: `encode_batch`
    without character offsets, which are not needed here), or `fast`, the same ids from
    `fast_encoder.fast_encoder(tokenizer)`.
    """
    eos = [eos_id(tokenizer)] if append_eos else []
    encoded: list[np.ndarray] = []
    for start in range(0, len(documents), ENCODE_CHUNK):
        chunk = list(documents[start : start + ENCODE_CHUNK])
        if fast is not None:
            ids = fast.encode_batch(chunk)
        else:
            ids = [encoding.ids for encoding in tokenizer.encode_batch_fast(chunk)]
        encoded.extend(np.array(each + eos, dtype=np.int32) for each in ids)
    return encoded
