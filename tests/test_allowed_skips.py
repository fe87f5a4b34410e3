"""A test run that skips what CI should run fails: tests/support/allowed_skips.py.

Each case runs pytest on a few throwaway test files that skip (one laid out as the real
cuDNN case, whose skip is allowed), with the plugin loaded as tests/conftest.py loads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).parent / "support"

CUDNN = """
import pytest

@pytest.mark.parametrize("backend", ["xla", "cudnn"])
def test_backends_agree(backend):
    if backend == "cudnn":
        pytest.skip("cudnn attention needs an NVIDIA GPU (jax.default_backend() is not 'gpu')")
"""
"""tests/models/attention/test_attention.py's shape: its cudnn case may skip."""

OTHER = """
import pytest

@pytest.fixture
def tool():
    pytest.skip("no frobnicator on PATH")

def test_needs_a_tool(tool):
    pass

def test_runs():
    pass

def test_skips_for_the_gpu_reason_elsewhere():
    pytest.skip("cudnn attention needs an NVIDIA GPU")
"""
"""Skips no entry allows: in a fixture, and the cuDNN reason in another test."""


def run_pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p allowed_skips -p no:cacheprovider\n")
    env = {**os.environ, "PYTHONPATH": str(SUPPORT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_only_allowed_skips_pass(tmp_path):
    write(tmp_path, {"tests/models/attention/test_attention.py": CUDNN})
    done = run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout and "unexpected skips" not in done.stdout


@pytest.mark.parametrize(
    "workers", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["alone", "xdist"]
)
def test_a_skip_not_on_the_allow_list_fails_the_run_naming_it(tmp_path, workers):
    write(
        tmp_path, {"tests/models/attention/test_attention.py": CUDNN, "tests/test_other.py": OTHER}
    )
    done = run_pytest(tmp_path, *(["-p", "xdist", "-n", str(workers)] if workers else []))
    out = done.stdout
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, out + done.stderr
    assert "2 passed, 3 skipped" in out and "unexpected skips" in out
    assert "2 test(s) skipped without an entry in tests/support/allowed_skips.py" in out
    assert "tests/test_other.py::test_needs_a_tool: no frobnicator on PATH" in out
    assert "tests/test_other.py::test_skips_for_the_gpu_reason_elsewhere: cudnn" in out
    assert "test_attention.py::test_backends_agree[cudnn]:" not in out.split("unexpected skips")[1]


def test_a_failing_run_keeps_its_failure(tmp_path):
    write(tmp_path, {"tests/test_other.py": OTHER + "\ndef test_fails():\n    assert False\n"})
    done = run_pytest(tmp_path)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED and "unexpected skips" in done.stdout


def test_every_entry_says_why_and_todays_skips_are_allowed(repo_root):
    """The skips of a CPU host (cuDNN) and of a run without root (SLURM) are allowed, with
    the reasons the tests give today."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("allowed_skips", SUPPORT / "allowed_skips.py")
    skips = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(skips)
    assert all(entry.why.strip() and entry.reason for entry in skips.ALLOWED_SKIPS)
    for entry in skips.ALLOWED_SKIPS:
        module = entry.nodeid.split("::")[0]
        assert (repo_root / module).is_file(), entry
        assert entry.reason in (repo_root / module).read_text(), entry
    gpu = "cudnn attention needs an NVIDIA GPU (jax.default_backend() is not 'gpu')"
    for ids in ["mha-causal-cudnn", "gqa-documents-cudnn"]:
        assert skips.allowed(
            f"tests/models/attention/test_attention.py::test_backends_agree[{ids}]", gpu
        )
    assert not skips.allowed(
        "tests/models/attention/test_attention.py::test_backends_agree[mha-causal-xla]", gpu
    )
    root = "a SLURM cluster needs root (infra/slurm/single_node.sh installs and starts it)"
    slurm = "tests/launch/test_slurm_cluster.py::test_a_launched_job_trains_two_tasks_and_slurm_reports_it_done"
    assert skips.allowed(slurm, root)
    assert not skips.allowed(slurm, "SLURM cannot be installed here: no mirror")
