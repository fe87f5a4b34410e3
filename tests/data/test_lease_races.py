"""A token cache shared by several real processes, safe under races (issue 61).

Two and three processes (`lease_race_driver.py`) build one cache on local files under its
lease; the holder is stopped at seeded random points (tokenizing a shard, between the
splits' assembly, just before the commit of `meta.json`, before the pieces are deleted)
and killed there, or frozen (SIGSTOP) until another process has taken over and finished,
then let go. The cache must end byte-equal to a single uninterrupted build, and every
surviving run read the same batches. `bench/lease_races.py` runs 20 such kills.
The lease's own rules (expiry by missed renewals, not clocks; renewals that fail on a
real store error retried, then given up loudly) are tested in this process.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import build_token_cache
from loomax.data.token_cache.lease import BuildLease, lease_key, read_lease
from loomax.data.token_cache.shared import build_shared
from loomax.data.tokenizer import train_bpe_tokenizer

DRIVER = Path(__file__).with_name("lease_race_driver.py")
NUM_SHARDS = 6
POINTS = [f"shard:{k}" for k in range(NUM_SHARDS)] + ["assemble", "commit", "clean"]
"""Where a holder can be stopped, in the order a build passes them."""
TTL_S = 1.0


def make_corpus(root: Path) -> SimpleNamespace:
    """Six small JSONL shards and a BPE trained on them."""
    texts = []
    for k in range(NUM_SHARDS):
        docs = [f"shard {k} doc {i}: " + "lorem ipsum " * (i % 6) for i in range(20 + 5 * k)]
        (root / f"s{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        texts += docs
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(texts, 300, tokenizer)
    return SimpleNamespace(
        urls=[str(root / f"s{{0..{NUM_SHARDS - 1}}}.jsonl")], tokenizer=tokenizer
    )


def driver_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lease_race_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_build(corpus: SimpleNamespace, cache: Path) -> SimpleNamespace:
    """One uninterrupted build (no lease): its files (but the ledger) and its batches' digest."""
    driver = driver_module()
    shards = source_shards(SourceConfig(urls=corpus.urls))
    info = build_token_cache(
        shards, corpus.tokenizer, cache, holdout_fraction=driver.HOLDOUT, progress=False
    )
    names = [shard.name for shard in shards]
    return SimpleNamespace(
        files=cache_files(cache), digest=driver.batches_digest(str(cache), info.fingerprint, names)
    )


def cache_files(cache: Path) -> dict[str, bytes]:
    """Every file of a cache but its ledger (whose entries name their piece and node)."""
    return {
        str(path.relative_to(cache)): path.read_bytes()
        for path in sorted(cache.rglob("*"))
        if path.is_file() and path.relative_to(cache).parts[0] != "ledger"
    }


def seeded_points(seed: int, kills: int) -> list[str]:
    """`kills` distinct stopping points drawn by `seed`, in the order a build meets them."""
    return sorted(random.Random(seed).sample(POINTS, kills), key=POINTS.index)


def wait_for_mark(marks: Path, point: str, processes: list, timeout: float = 90) -> int:
    """The pid of the process that stopped at `point` (written in its mark)."""
    deadline = time.monotonic() + timeout
    while True:
        mark = marks / point
        if mark.exists() and mark.read_text():
            return int(mark.read_text())
        if all(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            raise AssertionError(f"no process stopped at {point}")
        time.sleep(0.02)


def start(corpus, root: Path, processes: int, points: list[str], stall: bool = False):
    cache, marks, out = root / "tokens" / "train0", root / "marks", root / "out"
    marks.mkdir(parents=True)
    out.mkdir()
    args = {
        "urls": corpus.urls,
        "tokenizer": str(corpus.tokenizer),
        "cache": str(cache),
        "lease_ttl": TTL_S,
        "poll": 0.05,
        "marks": str(marks),
        "points": points,
        "stall": stall,
        "out": str(out),
    }
    command = [sys.executable, str(DRIVER), json.dumps(args)]
    procs = [subprocess.Popen(command) for _ in range(processes)]
    return SimpleNamespace(cache=cache, marks=marks, out=out, procs=procs)


def finish_all(race, timeout: float = 120) -> None:
    try:
        for proc in race.procs:
            proc.wait(timeout)
    finally:
        for proc in race.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_kills(corpus, root: Path, processes: int, points: list[str]) -> SimpleNamespace:
    """`processes` builders; the holder killed at each of `points` in turn."""
    race = start(corpus, root, processes, points)
    race.killed = []
    try:
        for point in points:
            pid = wait_for_mark(race.marks, point, race.procs)
            os.kill(pid, signal.SIGKILL)
            race.killed.append(pid)
    finally:
        finish_all(race)
    return race


def check_outcome(race, reference) -> None:
    """Killed processes died of the kill, the others finished with the reference's batches;
    the cache is byte-equal to the reference, pieces gone, the lease released."""
    for proc in race.procs:
        if proc.pid in race.killed:
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == 0, f"a surviving builder failed ({proc.returncode})"
            result = json.loads((race.out / f"{proc.pid}.json").read_text())
            assert result["digest"] == reference.digest, "a run's batches changed"
    files = cache_files(race.cache)
    assert not [name for name in files if name.startswith("pieces/")], "pieces left"
    assert files.keys() == reference.files.keys()
    for name, data in files.items():
        assert data == reference.files[name], f"{name} differs from an uninterrupted build"
    assert read_lease(str(race.cache))["owner"] is None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("races"))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    return reference_build(corpus, tmp_path_factory.mktemp("reference") / "train0")


@pytest.mark.slow
@pytest.mark.parametrize(("processes", "seed"), [(2, 3), (3, 0)])  # shard:3; assemble, clean
def test_builders_killed_at_random_points_leave_the_cache_of_one_build(
    processes, seed, corpus, reference, tmp_path
):
    points = seeded_points(seed, processes - 1)
    race = run_kills(corpus, tmp_path, processes, points)
    assert len(race.killed) == processes - 1, points
    check_outcome(race, reference)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["shard:2", "commit"])
def test_a_frozen_holder_let_go_after_a_takeover_writes_nothing(point, corpus, reference, tmp_path):
    """The holder frozen (SIGSTOP) in a task or just before its commit, past its lease; the
    other process takes over and finishes. Let go, the stale holder (and its task) must not
    write a byte: no ledger entry, no piece, no array, no `meta.json` (fenced on the lease)."""
    race = start(corpus, tmp_path, 2, [point], stall=True)
    race.killed = []
    try:
        pid = wait_for_mark(race.marks, point, race.procs)
        os.kill(pid, signal.SIGSTOP)
        other = next(p for p in race.procs if p.pid != pid)
        assert other.wait(120) == 0
        before = {
            str(p): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in race.cache.rglob("*")
            if p.is_file()
        }
        os.kill(pid, signal.SIGCONT)
        (race.marks / f"{point}.go").touch()
    finally:
        finish_all(race)
    after = {
        str(p): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in race.cache.rglob("*")
        if p.is_file()
    }
    assert after == before, "the stale holder wrote to the cache after it was replaced"
    check_outcome(race, reference)


def test_a_damaged_complete_cache_is_repaired_only_under_the_lease(corpus, reference, tmp_path):
    """A run that finds a complete cache damaged does not delete or rebuild it while another
    run holds its lease (that run may be reading or mending it): it waits, then repairs it
    under the lease, back to the uninterrupted build."""
    shards = source_shards(SourceConfig(urls=corpus.urls))
    cache = tmp_path / "tokens" / "train0"
    holdout = driver_module().HOLDOUT
    build_token_cache(shards, corpus.tokenizer, cache, holdout_fraction=holdout, progress=False)
    [stored] = [p for p in (cache / "train" / "tokens").rglob("*") if p.name == "0"]
    stored.write_bytes(stored.read_bytes()[:-7])  # truncated: found on open by its size
    other = BuildLease(str(cache), ttl_s=30, owner="another run")
    assert other.acquire()
    done = threading.Event()

    def repair() -> None:
        build_shared(
            shards, corpus.tokenizer, cache, holdout_fraction=holdout, progress=False, poll_s=0.05
        )
        done.set()

    thread = threading.Thread(target=repair)
    thread.start()
    try:
        assert not done.wait(0.6), "repaired while another run held the lease"
        assert (cache / "meta.json").exists() and stored.stat().st_size > 0  # untouched
    finally:
        other.release()
        thread.join(60)
    assert done.is_set()
    assert cache_files(cache) == reference.files


def test_a_dead_holder_is_replaced_after_missed_renewals_whatever_its_clock(tmp_path):
    """Expiry counts missed renewals on the waiter's own clock: a record from a host whose
    clock runs a day ahead (old rule: not expired for a day) is taken over after the TTL,
    with the next fence; a live holder whose clock lags is never taken over."""
    cache = str(tmp_path / "tokens" / "train0")
    folder, key = lease_key(cache)
    Path(folder).mkdir(parents=True)
    ahead = time.time() + 86400
    record = {"owner": "far:1:x", "fence": 3, "beat": 9, "ttl_s": 0.3, "expires": ahead}
    (Path(folder) / key).write_text(json.dumps({**record, "written_at": ahead}))
    waiter = BuildLease(cache, ttl_s=0.3, owner="here")
    assert not waiter.acquire()
    time.sleep(0.35)
    assert waiter.acquire() and waiter.fence == 4
    waiter.release()
    live, other = BuildLease(cache, ttl_s=0.3, owner="live"), BuildLease(cache, 0.3, owner="b")
    assert live.acquire() and live.fence == 5
    with live.held():
        deadline = time.monotonic() + 1.2  # four TTLs: renewed every 0.1 s meanwhile
        while time.monotonic() < deadline:
            assert not other.acquire(), "a renewed lease was taken over"
            time.sleep(0.05)
    assert not live.lost.is_set() and other.acquire() and other.fence == 6


def test_confirming_while_the_thread_renews_never_loses_the_lease(tmp_path):
    """`confirm` (before a commit) and the renewal thread both compare-and-swap the record:
    taking turns, neither fails the other's (which would set `lost` on a held lease)."""
    lease = BuildLease(str(tmp_path / "train0"), ttl_s=0.15, owner="me")  # renewed every 0.05 s
    assert lease.acquire()
    with lease.held():
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            lease.confirm()
        assert not lease.lost.is_set()


def test_renewals_that_fail_on_the_store_are_retried_then_given_up_loudly(tmp_path, caplog):
    """The lease's record made unreadable for a moment (a symlink loop in its place: the
    store's reads fail) is ridden out by retries; for longer than the lease, the renewals
    give up: `lost` is set, an error logged, and `check` refuses the next write."""
    cache = str(tmp_path / "shared" / "train0")
    lease = BuildLease(cache, ttl_s=1.2, owner="me")  # renewed every 0.4 s, retried every 0.1 s
    assert lease.acquire()
    record = Path(lease_key(cache)[0]) / lease.key
    moved = tmp_path / "moved.json"

    def break_store(seconds: float) -> None:
        record.rename(moved)
        record.symlink_to(record)
        time.sleep(seconds)
        record.unlink()
        moved.rename(record)

    with caplog.at_level(logging.WARNING, "loomax.data.token_cache.lease"), lease.held():
        time.sleep(0.3)
        break_store(0.3)  # the renewal at 0.4 s and a retry fail, then one succeeds
        time.sleep(0.45)
        assert not lease.lost.is_set()
        lease.check()
        assert "retrying" in caplog.text
        broken = threading.Thread(target=break_store, args=(1.6,))
        broken.start()
        deadline = time.monotonic() + 1.5
        while not lease.lost.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lease.lost.is_set(), "the renewals failed past the lease and it was not lost"
        with pytest.raises(Exception, match="lost"):
            lease.check()
        broken.join()
    assert "giving up the build lease" in caplog.text


def test_a_holder_that_ended_on_this_host_is_replaced_at_once(tmp_path):
    """A record written on this host by a process that has ended (a run killed here) is
    taken over without waiting for its TTL; one of a process that still runs is not."""
    import os
    import socket
    import subprocess
    import sys

    cache = str(tmp_path / "tokens" / "train0")
    folder, key = lease_key(cache)
    Path(folder).mkdir(parents=True)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    record = {"owner": "gone", "host": socket.gethostname(), "fence": 2, "beat": 5, "ttl_s": 600}
    (Path(folder) / key).write_text(json.dumps({**record, "pid": int(ended.stdout)}))
    waiter = BuildLease(cache, ttl_s=600, owner="here")
    assert waiter.acquire() and waiter.fence == 3  # at once: its TTL is ten minutes
    waiter.release()
    alive = {**record, "owner": "alive", "fence": 3, "pid": os.getppid()}
    (Path(folder) / key).write_text(json.dumps(alive))
    assert not BuildLease(cache, ttl_s=600, owner="other").acquire()
