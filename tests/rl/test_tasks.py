"""The shipped sorting task: the files are the generator's, answers are right, held-out prompts
are new; a bad prompt line is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loomax.errors import DataSourceError
from loomax.rl.tasks import make_sets, read_prompts

SHIPPED = Path(__file__).parents[2] / "config" / "rl" / "sort_letters"


def test_the_shipped_prompts_are_the_generators_and_held_out_ones_are_new():
    train, validation = make_sets()
    for name, rows in (("train", train), ("validation", validation)):
        assert [
            json.loads(line) for line in (SHIPPED / f"{name}.jsonl").read_text().splitlines()
        ] == rows
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in validation}
    for row in validation:
        letters = row["prompt"].removeprefix("sort: ").removesuffix(" =").split()
        assert row["answer"].split() == sorted(letters)


def test_a_bad_prompt_line_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "b"}\n{"answer": "b"}\n')
    with pytest.raises(DataSourceError, match=r"p.jsonl:2: needs a non-empty string 'prompt'"):
        read_prompts(path)
