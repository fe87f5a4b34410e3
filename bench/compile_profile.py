"""Summarises a ``bench/compile_profile_site`` log: where the processes' CPU went (XLA
compiles, traces, lowerings, the rest), the dearest programs, and per test file.

    COMPILE_PROFILE_OUT=/tmp/c.jsonl PYTHONPATH=$PWD/bench/compile_profile_site:$PWD/tests/support/gc_site make test
    .venv/bin/python bench/compile_profile.py /tmp/c.jsonl
"""

from __future__ import annotations

import collections
import json
import sys


def summarise(path: str, top: int = 25) -> str:
    """The log at ``path`` as text: totals, then the ``top`` programs and test files."""
    procs = [json.loads(line) for line in open(path)]
    lines = [f"{len(procs)} processes, {sum(p['cpu'] for p in procs):.0f} CPU-s"]
    by_kind: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    programs: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for proc in procs:
        for kind, name, _, cpu, test in proc["rec"]:
            by_kind[kind] += cpu or 0.0
            counts[kind] += 1
            if kind == "C":
                programs[name][0] += 1
                programs[name][1] += cpu or 0.0
            files[test.split("::")[0] or " ".join(proc["argv"][:1])][kind] += cpu or 0.0
    started = sum(p["first_compile_cpu"] or 0.0 for p in procs)
    lines.append(
        "compile {:.0f} CPU-s ({} programs), trace {:.0f} ({}), lowering {:.0f} ({}); "
        "before each process's first event {:.0f}".format(
            by_kind["C"], counts["C"], by_kind["T"], counts["T"], by_kind["L"], counts["L"], started
        )
    )
    lines.append(f"\ndearest programs by XLA compile CPU-s (count, CPU-s, name), top {top}:")
    for name, (n, cpu) in sorted(programs.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {n:6d} {cpu:8.1f}  {name}")
    lines.append(f"\ntest files by compile+trace+lowering CPU-s (C, T, L), top {top}:")
    for name, k in sorted(files.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        lines.append(f"  {k['C']:7.1f} {k['T']:6.1f} {k['L']:6.1f}  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarise(sys.argv[1]))
