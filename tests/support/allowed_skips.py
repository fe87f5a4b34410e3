"""A test run that skips what CI should run fails: skips come only from ``ALLOWED_SKIPS``.

A skip hides a test as quietly as a deselection (a missing tool, a fixture that gave up),
so `make test` and CI would pass without running it. This pytest plugin (registered by
tests/conftest.py) lets a test skip only where its node id and its reason match an entry
of ``ALLOWED_SKIPS``, each a condition of the host that CI cannot change and under which
the test has nothing to check (no GPU for cuDNN, no root for a SLURM cluster). Any other
skip turns the run's exit status into a failure, naming the tests and their reasons; the
tests themselves still show as skipped. With pytest-xdist the controller decides, from
every worker's reports. ``-k``/``-m`` deselect (tests/test_ci.py keeps `make test` from
that); they do not skip.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import pytest


class AllowedSkip(NamedTuple):
    """Tests whose node id matches ``nodeid`` (``*`` matches any characters) may skip with a reason
    containing ``reason``; ``why`` says why CI cannot run them everywhere."""

    nodeid: str
    reason: str
    why: str


ALLOWED_SKIPS = (
    AllowedSkip(
        "tests/models/attention/test_attention.py::test_backends_agree[*cudnn*]",
        "cudnn attention needs an NVIDIA GPU",
        "cuDNN runs only on an NVIDIA GPU; CPU hosts (CI) cannot run the 4 cudnn cases",
    ),
    AllowedSkip(
        "tests/launch/test_slurm_cluster.py::*",
        "a SLURM cluster needs root",
        "infra/slurm/single_node.sh installs and starts SLURM's daemons: root only",
    ),
    AllowedSkip(
        "tests/test_jax_setup.py::test_a_cpu_host_with_libtpu_starts_jax_without_tpu_noise",
        "this host has TPU chips",
        "it checks a host without TPU chips: on a TPU VM there is nothing to check",
    ),
    AllowedSkip(
        "tests/distributed/test_net.py::test_a_port_held_on_ipv6_only_is_not_free_for_every_interface",
        "no IPv6 sockets on this host",
        "a port held on IPv6 needs IPv6 sockets, which a host's kernel may not have",
    ),
)
"""Every skip a test run may have; any other fails the run (see the module)."""


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped report gives (pytest's ``(path, line, "Skipped: why")``)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def allowed(nodeid: str, reason: str) -> bool:
    """Whether ``ALLOWED_SKIPS`` lets test ``nodeid`` skip with ``reason``."""
    return any(
        re.fullmatch(".*".join(map(re.escape, entry.nodeid.split("*"))), nodeid)
        and entry.reason in reason
        for entry in ALLOWED_SKIPS
    )


_unexpected: dict[str, str] = {}
"""The skips of this run not in ``ALLOWED_SKIPS``: ``{node id: reason}``."""


def pytest_sessionstart(session: pytest.Session) -> None:
    _unexpected.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not allowed(report.nodeid, reason):
            _unexpected[report.nodeid] = reason


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _controller(session.config) and _unexpected and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not (_controller(config) and _unexpected):
        return
    terminalreporter.section("unexpected skips", sep="=", red=True, bold=True)
    terminalreporter.line(
        f"{len(_unexpected)} test(s) skipped without an entry in tests/support/allowed_skips.py's "
        "ALLOWED_SKIPS: the run fails (a skip hides what CI should run; fix the cause, or "
        "add an entry saying why CI cannot run it)",
        red=True,
    )
    for nodeid, reason in sorted(_unexpected.items()):
        terminalreporter.line(f"  {nodeid}: {reason}")


def _controller(config: pytest.Config) -> bool:
    """Whether this process is the one that reports (no xdist, or xdist's controller)."""
    return not hasattr(config, "workerinput")
