"""Shared token cache under races (issue 61): 20 randomised kills of real builder processes.

Each round starts 2 or 3 processes (alternately) building one token cache on local files
under its lease (`tests/data/lease_race_driver.py`, the suite's race test's driver), draws
(seed = round) 1 or 2 stopping points among: before each of the 6 shards is tokenized,
between the splits' assembly, just before the commit of `meta.json`, after it and before
the pieces are deleted; the holder that gets to each is killed there (SIGKILL). A round
passes when the killed processes died of it, the others ended with the batches of an
uninterrupted build (both orders), and the cache is byte-equal to that build (ledger
aside: its entries name their piece and node), pieces gone and the lease released.

    python bench/lease_races.py [--rounds 20] [--out bench/results/lease_races.json]

The last stdout line is the JSON written: every round's processes, points, outcome, seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
import traceback
from pathlib import Path

from machine import cpu_name  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _races():
    path = REPO / "tests" / "data" / "test_lease_races.py"
    spec = importlib.util.spec_from_file_location("test_lease_races", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    races = _races()
    rounds, load = [], Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory(prefix="lease-races-") as tmp:
        root = Path(tmp)
        (root / "corpus").mkdir()
        corpus = races.make_corpus(root / "corpus")
        reference = races.reference_build(corpus, root / "reference" / "train0")
        for seed in range(args.rounds):
            processes = 2 + seed % 2
            points = races.seeded_points(seed, processes - 1)
            began, record = time.monotonic(), {"seed": seed, "processes": processes}
            record["points"] = points
            try:
                race = races.run_kills(corpus, root / f"round{seed}", processes, points)
                record["returncodes"] = [proc.returncode for proc in race.procs]
                record["killed"] = len(race.killed)
                races.check_outcome(race, reference)
                record["passed"] = True
            except Exception as error:  # noqa: BLE001 - recorded, the other rounds go on
                record["passed"] = False
                record["error"] = "".join(traceback.format_exception_only(error)).strip()
            record["seconds"] = round(time.monotonic() - began, 2)
            rounds.append(record)
            print(json.dumps(record), flush=True)
    result = {
        "bench": "lease_races",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_name(),
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "load_before": load,
        "load_after": Path("/proc/loadavg").read_text().split()[:3],
        "lease_ttl_s": races.TTL_S,
        "passed": sum(r["passed"] for r in rounds),
        "rounds": rounds,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
