"""Shared test setup: CPU only, a persistent compilation cache, and small shared fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

from loomax._xla_flags import append_xla_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# no test reaches the Hugging Face Hub: models and configs are built locally, in tmp dirs
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

TEST_XLA_FLAGS = {"--xla_backend_optimization_level": "0", "--xla_cpu_use_fusion_emitters": "false"}
"""The tests compile thousands of small programs and run each a few times, so compiling is
most of their time. LLVM's -O0 code generation compiles them about a third faster, and
XLA's older elemental emitters for CPU fusions (instead of the MLIR fusion emitters)
about 2.5x faster again: a tiny trainer's init, three steps and an eager model build
compile in 2.5 s instead of 6.7 s, with bitwise the same losses. The HLO they run (what
the tests check) is the same. Processes the tests start inherit them; tests that set a
device count append theirs to ``XLA_FLAGS`` rather than replace it. A flag already in
``XLA_FLAGS`` is left as set."""
append_xla_flags(TEST_XLA_FLAGS)

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# one persistent compilation cache for the tests and the processes they start
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)


MACHINE_RAY_MODULES = ("test_ray_cluster.py", "test_pod_ray.py", "test_ray_nodes.py")
"""Modules that start or look for a machine-wide Ray cluster (`ray start`, "is one running?").
Each holds `machine_ray_lock` while it runs, so under pytest-xdist no two of them overlap;
other tests start private local clusters (`address="local"`) and may run side by side."""


RAY_MODULES: set[Path] = set()
"""The collected modules that use `ray_cluster` (filled at collection)."""


def pytest_collection_modifyitems(config, items) -> None:
    """Modules with `slow` tests go first (`make test` hands out whole files, `--dist
    loadfile`, in this order), so no worker is left with a long tail; within each part the
    modules that use `ray_cluster` come together, so a worker's Ray serves them in a row.
    A module's tests stay together: moving to another module and back would build its
    module fixtures twice."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    RAY_MODULES.update(item.path for item in items if "ray_cluster" in item.fixturenames)
    items.sort(key=lambda item: (item.path not in slow_modules, item.path not in RAY_MODULES))


@pytest.fixture(scope="module")
def machine_ray_lock(tmp_path_factory, request):
    """Held for the whole of a module in `MACHINE_RAY_MODULES` (an exclusive `flock` on a
    file every xdist worker of this run shares), so their machine-wide clusters never meet."""
    import fcntl

    assert request.path.name in MACHINE_RAY_MODULES, request.path
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's directory, above each worker's own
    with open(shared / "machine-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A few hundred small Python-like documents as one .jsonl file."""
    root = tmp_path_factory.mktemp("corpus")
    lines = []
    import json

    for i in range(400):
        body = "\n".join(f"    x{j} = {i} * {j} + {i % 7}" for j in range(i % 5 + 2))
        lines.append(json.dumps({"text": f"def f{i}(a, b):\n{body}\n    return a + b\n"}))
    path = root / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _stop_ray() -> None:
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs (builds of the token cache join it); its gcs address.

    One cluster serves a worker's consecutive modules that use it (each start costs ~5
    CPU-seconds, and an idle cluster ~7% of a core): `_ray_only_where_needed` stops it when
    a module that does not use it comes next."""
    import ray

    from loomax.distributed import RayConfig, init_ray

    if not ray.is_initialized():
        init_ray(RayConfig(num_cpus=2))
    assert ray.cluster_resources()["CPU"] == 2
    yield SimpleNamespace(address=ray.get_runtime_context().gcs_address)


@pytest.fixture(scope="module", autouse=True)
def _ray_only_where_needed(request):
    """Stops this process's Ray before a module that does not use `ray_cluster`: its tests
    may look for Ray, start their own or join another, and expect none running here."""
    if request.path not in RAY_MODULES:
        _stop_ray()
    yield


@pytest.fixture(scope="session", autouse=True)
def _ray_stopped_at_the_end():
    yield
    _stop_ray()


@pytest.fixture(scope="session")
def tiny():
    """One tiny trainer setup (tests/train/tiny_setup.py), shared by the hook and trainer tests."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "loomax_tests_tiny_setup", REPO / "tests" / "train" / "tiny_setup.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Tiny


@pytest.fixture(scope="session")
def processes_support():
    """tests/support/processes.py (children killed together, stderr shown, port retries)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "loomax_tests_processes", REPO / "tests" / "support" / "processes.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def libtpu() -> None:
    """libtpu is in the `test` extra (compiling for TPU topologies): without it, fail, don't skip."""
    import importlib.util

    assert importlib.util.find_spec("libtpu") is not None, (
        "compiling for TPU topologies needs libtpu, which the test extra installs: "
        "pip install -e '.[test]'"
    )
