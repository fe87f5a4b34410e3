"""Where the test suite's CPU time goes: by directory, file and test, from a profiled run.

A profiled run is pytest with `bench/suite_cpu_plugin.py` loaded (``-p suite_cpu_plugin``,
``bench/`` on ``PYTHONPATH``), one directory at a time (``-n 0``): it appends one JSON line
per test file (CPU seconds of the pytest process and of the children it waited for, wall
seconds) to ``$SUITE_PROFILE_OUT`` and one per test to ``$SUITE_PROFILE_OUT.tests``.

  python bench/suite_profile.py PROFILE.jsonl [PROFILE2.jsonl ...] [--slow-files FILE]

prints the totals by directory, the 30 dearest files, the 20 dearest tests, and the
two-worker schedule `make test` would get (whole files, in conftest's order: files with
`slow` tests first, listed one a line in ``--slow-files``), with CPU seconds standing in for
a quiet machine's wall seconds.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import defaultdict
from pathlib import Path


def read(paths: list[str], suffix: str = "") -> list[dict]:
    rows = []
    for path in paths:
        rows += [json.loads(line) for line in Path(path + suffix).read_text().splitlines()]
    return rows


def short(path: str) -> str:
    """``tests/...``, from an absolute or a repository-relative path."""
    return path if path.startswith("tests/") else "tests/" + path.split("/tests/", 1)[-1]


def directory(path: str) -> str:
    parts = short(path).split("/")
    return (
        "/".join(parts[:3])
        if len(parts) > 3
        else "/".join(parts[:2])
        if len(parts) > 2
        else "tests/*.py"
    )


def schedule(files: dict[str, float], slow: set[str], workers: int = 2) -> tuple[float, float]:
    """The makespan and the total of ``files`` handed out whole, slow files first, each to
    the worker that frees up first (xdist's loadfile)."""
    order = sorted(files, key=lambda f: (short(f) not in slow,))
    ends = [0.0] * workers
    for f in order:
        heapq.heapreplace(ends, ends[0] + files[f])
    return max(ends), sum(files.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--slow-files", help="tests/... paths of files with slow tests")
    args = parser.parse_args()
    files: dict[str, float] = defaultdict(float)
    for row in read(args.profiles):
        files[row["file"]] += row["cpu"]
    tests = read(args.profiles, ".tests")
    total = sum(files.values())
    print(f"{len(files)} files, {len(tests)} tests, {total:.0f} CPU-s in all")
    by_dir: dict[str, float] = defaultdict(float)
    for f, cpu in files.items():
        by_dir[directory(f)] += cpu
    print("\nCPU-s by directory (share of all):")
    for d, cpu in sorted(by_dir.items(), key=lambda x: -x[1]):
        print(f"  {cpu:7.1f}  {100 * cpu / total:4.1f}%  {d}")
    print("\nThe 30 dearest files (CPU-s):")
    for f, cpu in sorted(files.items(), key=lambda x: -x[1])[:30]:
        print(f"  {cpu:7.1f}  {short(f)}")
    print(
        "\nThe 20 dearest tests (CPU-s, wall-s; module fixtures count in the first test using them):"
    )
    for t in sorted(tests, key=lambda t: -t["cpu"])[:20]:
        print(f"  {t['cpu']:6.1f} {t['wall']:7.1f}  {t['id']}")
    print("\nTests by CPU-s each: how many, and their share of all tests' CPU-s:")
    all_tests = sum(t["cpu"] for t in tests)
    for low, high in [(0, 0.5), (0.5, 1), (1, 2), (2, 5), (5, 10), (10, 20), (20, float("inf"))]:
        band = [t["cpu"] for t in tests if low <= t["cpu"] < high]
        share = 100 * sum(band) / all_tests
        print(
            f"  {low:>4} to {high:<4}  {len(band):5d} tests  {sum(band):7.1f} CPU-s  {share:4.1f}%"
        )
    if args.slow_files:
        slow = set(Path(args.slow_files).read_text().split())
        makespan, work = schedule(files, slow)
        print(
            f"\nTwo workers, whole files, slow files first: makespan {makespan:.0f} s for "
            f"{work:.0f} s of work ({100 * work / (2 * makespan):.0f}% busy), CPU-s as wall-s"
        )


if __name__ == "__main__":
    main()
