"""CI runs every test: `.ci/run` is `make test`, and `make test` deselects nothing."""

from __future__ import annotations

import os
import shlex
import subprocess
import tomllib

DESELECTING = {
    "-m",
    "-k",
    "--deselect",
    "--ignore",
    "--ignore-glob",
    "--lf",
    "--last-failed",
    "--sw",
    "--stepwise",
    "-x",
    "--exitfirst",
    "--maxfail",
}
"""pytest options that leave tests out (or stop before they run)."""


def pytest_options(line: str) -> set[str]:
    return {arg.split("=")[0] for arg in shlex.split(line) if arg.startswith("-")}


def make_dry_run(repo_root, target: str) -> list[str]:
    """The command lines `make TARGET` would run (make -n: nothing runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "PYTEST"))}
    done = subprocess.run(
        ["make", "-n", target], cwd=repo_root, capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_ci_runs_make_test_and_nothing_else(repo_root):
    commands = [
        line.strip()
        for line in (repo_root / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))
    ]
    assert commands == ["make test"]


def test_make_test_deselects_no_test(repo_root):
    runs = [line for line in make_dry_run(repo_root, "test") if " -m pytest" in line]
    assert len(runs) == 1, runs
    assert not pytest_options(runs[0].split(" -m pytest", 1)[1]) & DESELECTING, runs[0]
    config = tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"]["pytest"]
    assert not pytest_options(config["ini_options"]["addopts"]) & DESELECTING


def test_make_test_fast_leaves_out_only_the_slow_tests(repo_root):
    runs = [line for line in make_dry_run(repo_root, "test-fast") if " -m pytest" in line]
    assert len(runs) == 1 and runs[0].endswith('-m "not slow"'), runs


def test_make_demo_installs_what_the_demo_runs_and_make_test_the_test_extra(repo_root, tmp_path):
    """`make demo` installs the package alone (no torch, libtpu, CUDA tools or lm-eval: the
    test extra); `make test` installs the test extra. Dry runs into a venv that is not there."""
    venv = f"VENV={tmp_path / 'venv'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "PYTEST"))}

    def installs(target: str) -> list[str]:
        done = subprocess.run(
            ["make", "-n", target, venv], cwd=repo_root, capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if " install " in line and " -e " in line]

    demo = installs("demo")
    assert demo and all(line.endswith(" -e .") for line in demo), demo
    test = installs("test")
    assert test and all('-e ".[test,docs]"' in line for line in test), test


def test_the_long_files_go_first_longest_first_and_every_listed_file_exists(repo_root):
    # `make test` hands whole files to its two workers in this order: a long file taken last
    # would leave the other worker idle for its whole length (the shipped-config compiles,
    # ~300 s, once ran last)
    import json
    import sys

    sys.path.insert(0, str(repo_root / "tests"))
    from conftest import FILE_COSTS, MACHINE_RAY_MODULES, schedule_key

    costs = json.loads(FILE_COSTS.read_text())
    assert costs["plan/test_shipped_configs.py"] == max(costs.values())
    for name in costs:
        assert (repo_root / "tests" / name).is_file(), f"{FILE_COSTS.name} lists {name}"
    tests = repo_root / "tests"
    paths = [
        tests / "test_ci.py",
        tests / "plan" / "test_shipped_configs.py",
        tests / "train" / "test_diloco.py",
        tests / "distributed" / MACHINE_RAY_MODULES[0],
    ]
    order = sorted(paths, key=lambda p: schedule_key(p, costs, slow=False, ray=False))
    assert order == [paths[3], paths[1], paths[2], paths[0]]
