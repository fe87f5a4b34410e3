"""The reference model's sequence log-probs: computed once, before training, and cached.

The reference is the policy's starting point (a fresh init, ``trainer.initialize_from_hf``
or ``trainer.initialize_from``). One pass over every pair (train and held-out) computes
``log π_ref`` of chosen and rejected; the trainer then never holds a second model. The
numbers are saved to an ``.npz`` beside the run (``dpo.reference_cache``) with a
fingerprint of the tokenised pairs, so a resumed run (whose state is no longer the
reference) reads them back, and a cache of other data is never used.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import numpy as np

from loomax.atomic_files import replace_path
from loomax.checkpoint.serialize import CheckpointError
from loomax.dpo.loss import sequence_logps
from loomax.dpo.pairs import PairArrays, pair_batches

logger = logging.getLogger(__name__)


def fingerprint(sets: Mapping[str, PairArrays]) -> str:
    """A hash of the tokenised pairs of every set (tokens and masks)."""
    digest = hashlib.sha256()
    for name in sorted(sets):
        digest.update(name.encode())
        arrays = sets[name]
        for a in (arrays.chosen, arrays.chosen_mask, arrays.rejected, arrays.rejected_mask):
            digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def compute_reference(
    model,
    sets: Mapping[str, PairArrays],
    rows: int,
    *,
    jit: Callable = jax.jit,
    place: Callable = lambda batch: batch,
    cast: Callable = lambda model: model,
) -> dict[str, np.ndarray]:
    """``{"<set>/chosen": [pairs], "<set>/rejected": [pairs]}``: ``model``'s sequence log-probs
    over the response tokens, ``rows`` pairs at a time (``jit``/``place``: the mesh's)."""

    def both(model, batch):
        model = cast(model)
        return (
            sequence_logps(model, batch["chosen"], batch["chosen_mask"]),
            sequence_logps(model, batch["rejected"], batch["rejected_mask"]),
        )

    both = jit(both)
    out = {}
    for name, arrays in sets.items():
        chosen, rejected = [], []
        for batch in pair_batches(arrays, rows):
            batch.pop("valid")
            c, r = both(model, place(batch))
            chosen.append(np.asarray(jax.device_get(c)))
            rejected.append(np.asarray(jax.device_get(r)))
        n = len(arrays)
        out[f"{name}/chosen"] = np.concatenate(chosen)[:n].astype(np.float32)
        out[f"{name}/rejected"] = np.concatenate(rejected)[:n].astype(np.float32)
    return out


def load_reference(path: Path, expected: str) -> dict[str, np.ndarray] | None:
    """The cached log-probs at ``path`` if they are of the pairs fingerprinted ``expected``."""
    if not path.is_file():
        return None
    with np.load(path) as f:
        if str(f["fingerprint"]) != expected:
            return None
        return {k: f[k] for k in f.files if k != "fingerprint"}


def save_reference(path: Path, logps: Mapping[str, np.ndarray], print_: str) -> None:
    """Write the log-probs and the pairs' fingerprint ``print_`` to ``path`` (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, fingerprint=np.array(print_), **logps)

    replace_path(path, write)


def reference_logps(
    path: Path,
    sets: Mapping[str, PairArrays],
    compute: Callable[[], dict[str, np.ndarray]] | None,
    *,
    save: bool = True,
) -> dict[str, np.ndarray]:
    """The reference log-probs of ``sets``: from the cache at ``path`` when it holds these
    pairs', else ``compute()`` (saved to ``path`` when ``save``). ``compute`` None (a resumed
    run, whose state is no longer the reference) and no usable cache is an error."""
    expected = fingerprint(sets)
    cached = load_reference(path, expected)
    if cached is not None:
        logger.info("dpo: reference log-probs read from %s", path)
        return cached
    if compute is None:
        raise CheckpointError(
            f"dpo: the run resumes from a checkpoint but {path} holds no reference log-probs "
            "of these pairs; point dpo.reference_cache at the first run's file"
        )
    logps = compute()
    if save:
        save_reference(path, logps, expected)
        logger.info("dpo: reference log-probs of %d sets cached in %s", len(sets), path)
    return logps
