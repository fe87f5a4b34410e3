"""Brace expansion of data source patterns."""

import pytest

from loomax.data.braces import expand_braces


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("plain.txt", ["plain.txt"]),
        ("shard_{0..3}.jsonl", [f"shard_{i}.jsonl" for i in range(4)]),
        ("shard_{3..1}", ["shard_3", "shard_2", "shard_1"]),
        ("s{08..10}", ["s08", "s09", "s10"]),
        ("{train,extra}/*.txt", ["train/*.txt", "extra/*.txt"]),
        ("{a,b}_{0..1}", ["a_0", "a_1", "b_0", "b_1"]),
        ("{a,b{1,2}}.txt", ["a.txt", "b1.txt", "b2.txt"]),
        ("{x}_{1,2}", ["{x}_1", "{x}_2"]),
        ("open{", ["open{"]),
    ],
)
def test_expand_braces(pattern: str, expected: list[str]) -> None:
    assert expand_braces(pattern) == expected
