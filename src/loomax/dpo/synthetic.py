"""The shipped preference set: sort the letters (a rule anyone can check).

Each prompt lists 3 to 6 distinct letters of ``a``–``l`` in a random order, ``sort: d a h =``;
the chosen response lists them in alphabetical order, `` a d h``; the rejected one lists
the same letters in another order (never sorted). ``is_preferred`` checks the rule. Run
``python -m loomax.dpo.synthetic OUT_DIR`` to write ``train.jsonl`` (2000 pairs) and
``validation.jsonl`` (200 pairs, other prompts) with a fixed seed: the files shipped in
``config/dpo/sort_letters/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

LETTERS = "abcdefghijkl"
"""The alphabet of the prompts."""


def make_pair(rng: np.random.Generator) -> dict[str, str]:
    """One pair: a prompt of distinct letters, its sorted listing, and an unsorted one."""
    k = int(rng.integers(3, 7))
    letters = [str(c) for c in rng.choice(list(LETTERS), size=k, replace=False)]
    rejected = list(letters)
    while rejected == sorted(letters):
        rejected = [str(c) for c in rng.permutation(letters)]
    return {
        "prompt": "sort: " + " ".join(letters) + " =",
        "chosen": " " + " ".join(sorted(letters)),
        "rejected": " " + " ".join(rejected),
    }


def is_preferred(prompt: str, response: str) -> bool:
    """The rule: the response lists the prompt's letters in alphabetical order."""
    letters = prompt.removeprefix("sort: ").removesuffix(" =").split()
    return response.split() == sorted(letters)


def make_sets(n_train: int = 2000, n_validation: int = 200, seed: int = 0):
    """``(train, validation)`` pairs; no validation prompt appears in train."""
    rng = np.random.default_rng(seed)
    seen, train, validation = set(), [], []
    while len(train) < n_train or len(validation) < n_validation:
        pair = make_pair(rng)
        if len(validation) < n_validation and pair["prompt"] not in seen:
            validation.append(pair)
        elif len(train) < n_train and all(pair["prompt"] != v["prompt"] for v in validation):
            train.append(pair)
        seen.add(pair["prompt"])
    return train, validation


def write_sets(out_dir: str | Path, **kwargs) -> None:
    """Write ``train.jsonl`` and ``validation.jsonl`` under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, pairs in zip(("train", "validation"), make_sets(**kwargs), strict=True):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))


if __name__ == "__main__":
    write_sets(sys.argv[1] if len(sys.argv) > 1 else "config/dpo/sort_letters")
