"""Shared test setup: CPU only, a persistent compilation cache, and small shared fixtures."""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from loomax._xla_flags import append_xla_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# no test reaches the Hugging Face Hub: models and configs are built locally, in tmp dirs
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _jaxlib_version() -> tuple[int, ...]:
    """jaxlib's version as integers, read without importing jax (flags must be set first)."""
    from importlib.metadata import version

    return tuple(int(p) for p in re.findall(r"\d+", version("jaxlib"))[:3])


TEST_XLA_FLAGS = {
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_parallel_codegen_split_count": "1",
}
if _jaxlib_version() < (0, 11):  # jaxlib 0.11's XLA dropped the flag, and aborts on it
    TEST_XLA_FLAGS["--xla_cpu_use_fusion_emitters"] = "false"
"""The tests compile thousands of small programs and run each a few times, so compiling is
most of their time. LLVM's -O0 code generation compiles them about a third faster, and
XLA's older elemental emitters for CPU fusions (instead of the MLIR fusion emitters)
about 2.5x faster again: a tiny trainer's init, three steps and an eager model build
compile in 2.5 s instead of 6.7 s, with bitwise the same losses. One LLVM module per
program instead of several compiled side by side spares the splitting (`llvm::SplitModule`),
which the two busy cores gain nothing from: a tiny trainer's init and three steps take
1.26 instead of 1.46 CPU-seconds. The HLO they run (what the tests check) is the same.
Processes the tests start inherit them; tests that set a device count append theirs to
``XLA_FLAGS`` rather than replace it. A flag already in ``XLA_FLAGS`` is left as set."""
append_xla_flags(TEST_XLA_FLAGS)

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GC_SITE = REPO / "tests" / "support" / "gc_site"
"""The cyclic garbage collector's thresholds (its ``sitecustomize.py`` says why): applied
here, and on the ``PYTHONPATH`` of the processes the tests start, which import it first."""
if str(GC_SITE) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(GC_SITE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


def _tune_gc() -> None:
    import gc
    import importlib.util

    gc.collect()
    gc.freeze()  # what the imports made is never garbage: out of every later scan
    spec = importlib.util.spec_from_file_location("loomax_gc_site", GC_SITE / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # sets the thresholds


_tune_gc()

# One persistent compilation cache for the tests and the processes they start. Programs that
# take 0.1 s or more to compile go in it: on a cold run ~60 of the tiny trainers' train steps
# and inits repeat a program another test or process compiled before (~20 CPU-s of compiling),
# while the ~2,000 eager ops under it would cost more to write than they save.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)


RUN_DIR_ENV = "LOOMAX_TEST_RUN_DIR"
"""A directory of this test run that the controller and every xdist worker share (locks, the
shared Ray head's record); made by the controller, removed when the run ends."""


@functools.cache
def load_test_module(relative: str):
    """The file ``tests/<relative>`` as a module, loaded once (the tests are not a package)."""
    import importlib.util

    name = "loomax_tests_" + relative.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _support(name: str):
    """tests/support/<name>.py as a module."""
    return load_test_module(f"support/{name}.py")


def pytest_configure(config) -> None:
    # a skip not on tests/support/allowed_skips.py's ALLOWED_SKIPS fails the run
    config.pluginmanager.register(_support("allowed_skips"), "loomax_allowed_skips")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        import tempfile

        os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="loomax-test-run-")


def pytest_unconfigure(config) -> None:
    """The controller, after every worker is done: stop the shared Ray head, if one started."""
    if not hasattr(config, "workerinput") and RUN_DIR_ENV in os.environ:
        import shutil

        run_dir = Path(os.environ.pop(RUN_DIR_ENV))
        _support("ray_nodes").stop_shared_head(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)


def run_dir() -> Path:
    return Path(os.environ[RUN_DIR_ENV])


MACHINE_RAY_MODULES = ("test_ray_cluster.py", "test_pod_ray.py", "test_ray_nodes.py")
"""Modules that start or look for a machine-wide Ray cluster (`ray start`, "is one running?").
`make test` hands them to one worker as a single unit (`pytest_xdist_make_scheduler`), in a
row; each also holds `machine_ray_lock` while it runs, so that no two of them overlap under
any other distribution either. The other Ray tests join the run's shared head
(`ray_cluster`), which is invisible to these (its own temp dir), and may run side by side."""


RAY_MODULES: set[Path] = set()
"""The collected modules that use `ray_cluster` (filled at collection)."""


FILE_COSTS = REPO / "tests" / "support" / "file_costs.json"
"""The test files that take long (wall seconds on a `make test` worker; `bench/suite_file_costs.py`
writes it from a run's timeline)."""


def schedule_key(path: Path, costs: dict[str, int], slow: bool, ray: bool) -> tuple:
    """Where a module's tests go in the run: the machine-wide Ray modules first (mostly
    waiting on Ray's daemons, they overlap best with work that needs the CPU), then the long
    files of `FILE_COSTS`, longest first (`make test` hands out whole files in this order, so
    the last files a worker takes are short and the two workers end together), then modules
    with `slow` tests, then the rest; within each part the modules that use `ray_cluster` come
    together, so a worker's Ray serves them in a row."""
    cost = (
        costs.get(path.relative_to(REPO / "tests").as_posix(), 0)
        if path.is_relative_to(REPO / "tests")
        else 0
    )
    return (path.name not in MACHINE_RAY_MODULES, -cost, not slow, not ray)


def pytest_collection_modifyitems(config, items) -> None:
    """Sorts the modules by `schedule_key`. A module's tests stay together: moving to another
    module and back would build its module fixtures twice (the sort is stable)."""
    import json

    costs = json.loads(FILE_COSTS.read_text()) if FILE_COSTS.exists() else {}
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    RAY_MODULES.update(item.path for item in items if "ray_cluster" in item.fixturenames)
    items.sort(
        key=lambda item: schedule_key(
            item.path, costs, item.path in slow_modules, item.path in RAY_MODULES
        )
    )


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown when xdist is off
def pytest_xdist_make_scheduler(config, log):
    """Whole files to each worker (as `--dist loadfile`), except that the machine-wide Ray
    modules are one unit: a second worker would only wait on `machine_ray_lock` for them."""
    if config.getoption("dist") != "loadfile":
        return None  # xdist's own scheduler for the other modes
    from xdist.scheduler import LoadFileScheduling

    class FilesWithMachineRayTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "machine-ray" if Path(path).name in MACHINE_RAY_MODULES else path

    return FilesWithMachineRayTogether(config, log)


@pytest.fixture(scope="module")
def machine_ray_lock(request):
    """Held for the whole of a module in `MACHINE_RAY_MODULES` (an exclusive `flock` on a
    file every xdist worker of this run shares), so their machine-wide clusters never meet."""
    import fcntl

    assert request.path.name in MACHINE_RAY_MODULES, request.path
    with open(run_dir() / "machine-ray.lock", "w") as lock:
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
    """The run's shared Ray cluster (one head of 2 CPUs on 127.0.0.1, which builds of the
    token cache join), this process connected to it; its gcs address.

    One head serves every worker of the run (`tests/support/ray_nodes.py`: a start costs
    ~10-25 CPU-seconds and ~15 s); this process stays connected over its consecutive
    modules that use it, and `_ray_only_where_needed` disconnects it before a module that
    does not."""
    import ray

    from loomax.distributed import RayConfig, init_ray
    from loomax.distributed.net import free_port

    if not ray.is_initialized():
        init_ray(RayConfig(address=_support("ray_nodes").shared_head(run_dir(), free_port)))
    assert ray.cluster_resources()["CPU"] == 2
    yield SimpleNamespace(address=ray.get_runtime_context().gcs_address)


@pytest.fixture(scope="session")
def build_data():
    """``build_data(config_path, *overrides)``: the tokenizer and token caches of that run
    config, built here on the run's shared Ray cluster. A training subprocess with the same
    data settings then finds them ready and starts no Ray of its own (~17 CPU-seconds and
    ~20 s each): for scenarios about something else (launchers, faults)."""
    from loomax.config import parse_config
    from loomax.data import build_lm_datasets
    from loomax.distributed import RayConfig
    from loomax.distributed.net import free_port
    from loomax.lm.config import TrainLmConfig

    def build(config_path: Path | str, *overrides: str) -> None:
        config = parse_config(TrainLmConfig, str(config_path), list(overrides))
        address = _support("ray_nodes").shared_head(run_dir(), free_port)
        build_lm_datasets(config.data, config.model.seq_len, ray=RayConfig(address=address))

    return build


@pytest.fixture(scope="module", autouse=True)
def _ray_only_where_needed(request):
    """Disconnects this process from Ray before a module that does not use `ray_cluster`:
    its tests may look for Ray, start their own or join another, and expect none here."""
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
    return load_test_module("train/tiny_setup.py").Tiny


@pytest.fixture(scope="session")
def resume_helpers():
    """tests/train/test_resume.py's helpers (make_trainer, start, terminate_at, params)."""
    return load_test_module("train/test_resume.py")


@pytest.fixture(scope="session")
def autogroups():
    """tests/support/autogroups.py (code in an autogroup of its own; what the kernel allows)."""
    return _support("autogroups")


@pytest.fixture(scope="session")
def families():
    """tests/support/families.py (every registered model type, and a tiny config of each)."""
    return _support("families")


@pytest.fixture(scope="session")
def lm_eval_tasks():
    """tests/support/lm_eval_tasks.py (tiny lm-eval tasks over local JSONL files, their corpus)."""
    return _support("lm_eval_tasks")


@pytest.fixture(scope="session")
def plan_runs():
    """tests/support/plan_runs.py (tiny run configs for the compile tests, compiled once)."""
    return _support("plan_runs")


@pytest.fixture(scope="session")
def json_worker():
    """tests/support/cpu_workers.py's ``run_json_worker``: a worker script on fake CPU devices."""
    return _support("cpu_workers").run_json_worker


@pytest.fixture(scope="session")
def processes_support():
    """tests/support/processes.py (children killed together, stderr shown, port retries)."""
    return _support("processes")


@pytest.fixture(scope="session")
def ray_nodes_support():
    """tests/support/ray_nodes.py (Ray nodes started with `ray start`, stopped with their group)."""
    return _support("ray_nodes")


def require_test_extra(module: str, needed_for: str) -> None:
    """Fail, don't skip, where ``module`` (installed by the `test` extra) is missing: a
    missing package must not turn the tests that need it into silent skips."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.fail(
            f"{needed_for} needs the Python module {module}, which the test extra installs: "
            "pip install -e '.[test]'",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def require_extra():
    """``require_test_extra`` itself (for the test that checks it fails)."""
    return require_test_extra


@pytest.fixture(scope="session")
def libtpu() -> None:
    """libtpu is in the `test` extra (compiling for TPU topologies): without it, fail, don't skip."""
    require_test_extra("libtpu", "compiling for TPU topologies")


@pytest.fixture(scope="session")
def needs_lm_eval() -> None:
    """lm-eval is in the `test` extra (tests/downstream, the downstream hook): fail, don't skip."""
    require_test_extra("lm_eval", "running lm-eval's evaluator")


@pytest.fixture(scope="session")
def needs_transformers() -> None:
    """transformers and torch are in the `test` extra (tests/hf): fail, don't skip."""
    require_test_extra("torch", "comparing with transformers")
    require_test_extra("transformers", "comparing with transformers")


@pytest.fixture(scope="session")
def needs_peft(needs_transformers) -> None:
    """peft is in the `test` extra (tests/hf/test_peft: LoRA exports load in it): fail, don't skip."""
    require_test_extra("peft", "loading LoRA exports in peft")


@pytest.fixture(scope="session")
def needs_hf_backend(needs_lm_eval, needs_transformers) -> None:
    """lm-eval's `hf` backend (transformers, and accelerate, which it imports) is in the
    `test` extra: fail, don't skip."""
    require_test_extra("accelerate", "lm-eval's hf backend")
