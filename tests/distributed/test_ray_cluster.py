"""Ray settings: documented fields, checked values, and clear errors before any waiting."""

import dataclasses
import socket
import time

import pytest

from loomax.config import ConfigError
from loomax.config_reference import field_docs
from loomax.distributed import RayConfig, init_ray, ray_session

pytestmark = pytest.mark.usefixtures("machine_ray_lock")  # a machine-wide Ray cluster


def test_every_field_has_a_doc():
    docs = field_docs(RayConfig)
    assert [f.name for f in dataclasses.fields(RayConfig) if not docs.get(f.name)] == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_cpus": 0}, "ray.num_cpus must be >= 1"), ({"connect_timeout_s": 0}, "must be > 0")],
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayConfig(**kwargs)


@pytest.fixture
def ray():
    """ray, imported by the tests that use it (at collection every xdist worker would pay ~2 s)."""
    import ray

    return ray


@pytest.fixture
def no_ray(monkeypatch, ray):
    assert not ray.is_initialized(), (
        "Ray is already initialized in this test process: an earlier test left it running "
        "(shut it down there); these tests need to start from no Ray"
    )
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_unreachable_address_fails_fast_naming_it(no_ray, ray):
    with socket.socket() as held:  # bound, never listening: refused, and nobody else gets it
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"Ray cluster at '127\.0\.0\.1:{port}'"):
            init_ray(RayConfig(address=f"127.0.0.1:{port}", connect_timeout_s=2))
    assert time.monotonic() - start < 10 and not ray.is_initialized()


def test_malformed_address_is_refused(no_ray):
    with pytest.raises(ValueError, match="host:port"):
        init_ray(RayConfig(address="no-port-here"))


def test_no_address_and_no_auto_start_is_an_error(no_ray):
    with pytest.raises(ConfigError, match="auto_start_cluster"):
        with ray_session(RayConfig(auto_start_cluster=False)):
            pass


START_THEN_STOP = """
import sys
from jax._src import xla_bridge
import loomax.data.token_cache.placement as placement
import loomax.train_lm as train_lm

placement.SMALL_BUILD_BYTES = 0  # this corpus is small: build it on Ray anyway (the case here)
build = train_lm.build_lm_datasets

def build_then_stop(*args, **kwargs):  # the run up to its data, then no further
    build(*args, **kwargs)
    print("JAX backend started before the data:", xla_bridge.backends_are_initialized())
    raise SystemExit(0)

train_lm.build_lm_datasets = build_then_stop
from loomax.cli import main
main(sys.argv[1:])
"""


def test_loomax_train_starts_ray_before_jax_and_quietly(tmp_path, tiny_corpus):
    """`loomax train` up to its data build, whose token cache starts a local Ray: Ray forks
    its daemons before JAX starts threads (JAX's "os.fork() was called" warning), and
    Ray's notice of its default token authentication stays off the console."""
    import json
    import os
    import subprocess
    import sys

    args = ["train", "--data.train", json.dumps([{"urls": [str(tiny_corpus)]}])]
    args += ["--data.tokenizer_vocab_size", "300", "--data.cache_dir", str(tmp_path / "cache")]
    args += ["--trainer.run_dir", str(tmp_path / "run"), "--trainer.ray.num_cpus", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    done = subprocess.run(
        [sys.executable, "-c", START_THEN_STOP, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "JAX backend started before the data: False" in done.stdout
    assert "Started a local Ray instance" in done.stderr  # the fork this is about happened
    assert "os.fork()" not in done.stderr, done.stderr[-3000:]
    assert "Token authentication" not in done.stderr, done.stderr[-3000:]
