"""Shared test setup: CPU only, a persistent compilation cache, and small shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# no test reaches the Hugging Face Hub: models and configs are built locally, in tmp dirs
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
"""The tests compile hundreds of small programs and run each a few times: LLVM's -O0 code
generation compiles them about a third faster, and the HLO they run (what the tests
check) is the same. Processes the tests start inherit it; tests that set a device count
append theirs to ``XLA_FLAGS`` rather than replace it."""
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

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


def pytest_collection_modifyitems(config, items) -> None:
    """Modules with `slow` tests go first (`make test` hands out whole files, `--dist
    loadfile`, in this order), so no worker is left with a long tail. A module's tests stay
    together: moving to another module and back would build its module fixtures twice."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_modules)


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


@pytest.fixture(scope="module")
def ray_cluster():
    """A local 2-CPU Ray cluster for a test module (builds of the token cache join it)."""
    import ray

    from loomax.distributed import RayConfig, init_ray

    started = init_ray(RayConfig(num_cpus=2))
    yield
    if started:
        ray.shutdown()


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
