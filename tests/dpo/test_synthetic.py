"""The shipped preference set: its rule holds for every chosen response and no rejected one,
held-out prompts are not trained on, and the script writes the shipped files."""

from __future__ import annotations

from pathlib import Path

from loomax.dpo.pairs import read_pairs
from loomax.dpo.synthetic import is_preferred, write_sets

SHIPPED = Path(__file__).parents[2] / "config" / "dpo" / "sort_letters"


def test_the_shipped_set_follows_its_rule_and_is_what_the_script_writes(tmp_path):
    train, validation = (
        read_pairs(SHIPPED / "train.jsonl"),
        read_pairs(SHIPPED / "validation.jsonl"),
    )
    assert (len(train), len(validation)) == (2000, 200)
    for pair in train + validation:
        assert is_preferred(pair.prompt, pair.chosen)
        assert not is_preferred(pair.prompt, pair.rejected)
        assert sorted(pair.chosen.split()) == sorted(pair.rejected.split())  # same letters
    assert not {p.prompt for p in validation} & {p.prompt for p in train}
    write_sets(tmp_path)
    for name in ("train.jsonl", "validation.jsonl"):
        assert (tmp_path / name).read_text() == (SHIPPED / name).read_text()
