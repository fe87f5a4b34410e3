"""The token cache on a real 2-node Ray cluster started here (`ray start --head` and
`ray start --address`, each node with 1 CPU and a temp dir of its own): `loomax cache`
spreads the shards over both nodes, and killing the worker node mid-build still gives
the whole cache, token for token.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loomax.data.token_cache import TokenCache
from loomax.data.tokenizer import encode_documents, load_tokenizer, train_bpe_tokenizer
from loomax.distributed.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("machine_ray_lock")]  # machine-wide Ray

NUM_SHARDS = 8
MANY_SHARDS = 64
DRIVER = Path(__file__).with_name("token_cache_driver.py")


WAIT_FOR_CPUS = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.monotonic() + 60
while ray.available_resources().get("CPU", 0) < int(sys.argv[2]):
    assert time.monotonic() < deadline, ray.available_resources()
    time.sleep(0.1)
"""


def wait_for_cpus(address: str, env: dict[str, str], cpus: int) -> None:
    """Waits until the cluster reports `cpus` CPUs free: a node that has just started is
    not yet in the head's view, and a build started then would run on the head alone."""
    command = [sys.executable, "-c", WAIT_FOR_CPUS, address, str(cpus)]
    subprocess.run(command, env=env, check=True, timeout=90, capture_output=True)


@pytest.fixture(scope="module")
def two_nodes(ray_nodes_support):
    """A head and a worker node on 127.0.0.1, stopped at the end whatever happens. One
    cluster serves the module (a start is ~25 s of Ray's daemons coming up): the kill test,
    which leaves the head alone, comes last."""
    root = Path(tempfile.mkdtemp(prefix="lxray-"))  # short: Ray's socket paths live under it
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    fast_death = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "2"}
    nodes = ray_nodes_support
    started: list[subprocess.Popen] = []
    try:
        head_env = env | fast_death | {"LOOMAX_TEST_NODE": "head"}
        head, port = nodes.start_head(root, head_env, free_port, cpus=1)
        started.append(head)
        worker = [f"--address=127.0.0.1:{port}", f"--temp-dir={root}/w", "--num-cpus=1"]
        worker.append("--node-ip-address=127.0.0.1")
        worker_env = env | {"LOOMAX_TEST_NODE": "worker"}
        started.append(nodes.start_node(worker, root / "worker", worker_env))
        wait_for_cpus(f"127.0.0.1:{port}", env, 2)
        yield SimpleNamespace(address=f"127.0.0.1:{port}", env=env, worker=started[1])
    finally:
        for proc in reversed(started):
            nodes.stop_node(proc)
        shutil.rmtree(root, ignore_errors=True)


def make_corpus(root: Path, shards: int) -> SimpleNamespace:
    """`shards` small .jsonl files, their tokenizer, and their tokens made in this process."""
    documents = []
    for k in range(shards):
        shard = [f"shard {k} doc {i}: " + "spread the work, " * (i % 5) for i in range(10 + k % 8)]
        lines = "".join(json.dumps({"text": t}) + "\n" for t in shard)
        (root / f"part_{k:02d}.jsonl").write_text(lines)
        documents += shard
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(documents, 300, tokenizer)
    tokens = np.concatenate(encode_documents(load_tokenizer(tokenizer), documents))
    return SimpleNamespace(
        urls=[str(root / "part_*.jsonl")], tokenizer=str(tokenizer), tokens=tokens, shards=shards
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Eight small shards: with 1 s per shard, a node killed mid-build leaves some to do."""
    return make_corpus(tmp_path_factory.mktemp("corpus"), NUM_SHARDS)


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """Shards of ~40 ms each (mostly a task's fixed cost), enough of them to outlast the
    cold start of the worker node's first worker process: the head starts one for a new
    driver ahead of time, and its worker would otherwise take 8 quick shards alone."""
    return make_corpus(tmp_path_factory.mktemp("many"), MANY_SHARDS)


def ledger_nodes(cache: Path) -> list[str]:
    """The Ray node each ledger entry says tokenized its shard."""
    return [json.loads(p.read_text())["node"] for p in sorted((cache / "ledger").glob("*.json"))]


def test_cache_command_spreads_the_shards_over_both_nodes(two_nodes, many_shards, tmp_path):
    cache_dir = tmp_path / "cache"
    command = [
        sys.executable,
        "-m",
        "loomax.cli",
        "cache",
        "--data.train",
        json.dumps([{"urls": many_shards.urls}]),
        "--data.tokenizer",
        many_shards.tokenizer,
        "--data.validation",
        json.dumps([{"urls": [many_shards.urls[0].replace("*", "00")]}]),
        "--data.cache_dir",
        str(cache_dir),
        "--trainer.ray.address",
        two_nodes.address,
    ]
    done = subprocess.run(command, env=two_nodes.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{MANY_SHARDS} of {MANY_SHARDS} shards tokenized now" in done.stdout
    [cache] = [p for p in cache_dir.glob("tokens/train0-*") if p.is_dir()]  # not its lease
    nodes = ledger_nodes(cache)
    assert len(nodes) == MANY_SHARDS and len(set(nodes)) == 2, nodes  # both nodes did work
    np.testing.assert_array_equal(TokenCache.open(cache)["train"].as_numpy(), many_shards.tokens)


def test_killed_worker_node_still_gives_the_whole_cache(two_nodes, corpus, tmp_path):
    cache, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    args = {
        "urls": corpus.urls,
        "tokenizer": corpus.tokenizer,
        "cache": str(cache),
        "address": two_nodes.address,
        "sleep": 1.0,  # per shard: the worker node dies with shards left to do
        "marks": str(marks),
    }
    driver = subprocess.Popen(
        [sys.executable, str(DRIVER), json.dumps(args)],
        env=two_nodes.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not worker_finished_a_shard(cache, marks):
            assert driver.poll() is None, driver.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the worker node finished no shard"
            time.sleep(0.05)
        os.killpg(two_nodes.worker.pid, signal.SIGKILL)  # its raylet and workers, at once
        output, _ = driver.communicate(timeout=90)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 0, output[-3000:]
    roles = node_roles(marks)
    nodes = ledger_nodes(cache)
    assert len(nodes) == NUM_SHARDS and {roles[n] for n in nodes} == {"head", "worker"}
    assert nodes.count(worker_node(marks)) < NUM_SHARDS  # the head did the rest
    np.testing.assert_array_equal(TokenCache.open(cache)["train"].as_numpy(), corpus.tokens)
    assert TokenCache.open(cache).meta["shards"]["used"] == NUM_SHARDS


def node_roles(marks: Path) -> dict[str, str]:
    """Ray node id -> `head` or `worker`, as the tasks that ran there wrote it."""
    return dict(p.read_text().split() for p in marks.iterdir())


def worker_node(marks: Path) -> str | None:
    return next((n for n, role in node_roles(marks).items() if role == "worker"), None)


def worker_finished_a_shard(cache: Path, marks: Path) -> bool:
    if not (cache / "ledger").is_dir():
        return False
    worker = worker_node(marks)
    return worker is not None and worker in ledger_nodes(cache)
