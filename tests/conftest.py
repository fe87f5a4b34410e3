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


RAY_CLUSTER_MODULES = ("test_ray_cluster.py", "test_pod_ray.py", "test_ray_nodes.py")
"""Modules that start or look for a machine-wide Ray cluster (`ray start`, "is one running?").
Under pytest-xdist they share one worker (`--dist loadgroup`), so no two of them overlap;
other tests start private local clusters (`address="local"`) and may run side by side."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the `xdist_group` marks
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (`make test`): tests sharing a module-scoped fixture stay on one
    worker (it is built once, not once per worker); the Ray-cluster modules share one
    worker; `slow` tests are handed out first, so no worker is left with a long tail."""
    for item in items:
        if item.path.name in RAY_CLUSTER_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray-cluster"))
        elif _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _uses_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)  # pytest's resolved fixtures of the test
    if info is None:
        return False
    return any(
        defs and defs[-1].scope in ("module", "class", "package")
        for defs in info.name2fixturedefs.values()
    )


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
