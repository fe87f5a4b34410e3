"""Writes tests/support/file_costs.json: the test files that take long, from a suite timeline.

    SUITE_TIMELINE_OUT=/tmp/t.jsonl PYTHONPATH=bench make test PYTEST_ADDOPTS="-p suite_timeline_plugin"
    python bench/suite_file_costs.py /tmp/t.jsonl

`make test` hands whole files to its two workers in the order tests/conftest.py sorts them;
the files listed here (wall seconds on a worker, at least ``--min`` each) go first, longest
first, so that no worker starts a long file when the other is nearly done.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def file_costs(rows: list[dict], minimum: float) -> dict[str, int]:
    """Wall seconds per test file (relative to tests/), for files of at least ``minimum``."""
    out: dict[str, float] = {}
    for row in rows:
        name = Path(row["file"]).resolve().as_posix().split("/tests/", 1)[-1]
        out[name] = out.get(name, 0.0) + row["t1"] - row["t0"]
    return {k: round(v) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= minimum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", help="rows written by bench/suite_timeline_plugin.py")
    parser.add_argument("--min", type=float, default=20.0, help="seconds a listed file takes")
    parser.add_argument("--out", default=str(REPO / "tests" / "support" / "file_costs.json"))
    args = parser.parse_args()
    rows = [json.loads(line) for line in Path(args.timeline).read_text().splitlines() if line]
    costs = file_costs(rows, args.min)
    Path(args.out).write_text(json.dumps(costs, indent=1) + "\n")
    print(f"{len(costs)} files of >= {args.min:g} s, {sum(costs.values())} s in all -> {args.out}")


if __name__ == "__main__":
    main()
