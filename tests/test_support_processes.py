"""tests/support/processes.py: a failing child fails the test with its stderr, and its
siblings are killed; a scenario whose port was taken meanwhile is run once more."""

from __future__ import annotations

import sys
import time

import pytest

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def fails(message: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.stderr.write({message!r}); sys.exit(3)"]


def test_a_failing_child_shows_its_stderr_and_its_siblings_are_killed(tmp_path, processes_support):
    with processes_support.Processes(tmp_path) as processes:
        sleeper = processes.start("sleeper", SLEEPER)
        processes.start("broken", fails("boom: the reason\n"))
        start = time.monotonic()
        with pytest.raises(processes_support.ChildFailed, match=r"'broken' exited with code 3"):
            processes.wait(timeout=60)
        assert time.monotonic() - start < 30  # did not wait for the sleeper
        assert sleeper.poll() is not None  # killed, not left running
    with pytest.raises(AssertionError, match="boom: the reason"):
        with processes_support.Processes(tmp_path / "again") as processes:
            processes.start("broken", fails("boom: the reason\n"))
            processes.wait(timeout=60)


def test_a_taken_port_reruns_the_scenario_once(tmp_path, processes_support):
    attempts = []

    def scenario(processes):
        attempts.append(processes.directory.name)
        if len(attempts) == 1:
            processes.start("server", fails("bind: Address already in use\n"))
        else:
            processes.start("server", [sys.executable, "-c", "print('served')"])
        return processes.wait(timeout=60)["server"]

    assert processes_support.run_scenario(tmp_path, scenario) == "served\n"
    assert attempts == ["attempt-0", "attempt-1"]

    def always_broken(processes):
        processes.start("server", fails("some other error\n"))
        processes.wait(timeout=60)

    with pytest.raises(processes_support.ChildFailed, match="some other error"):
        processes_support.run_scenario(tmp_path / "other", always_broken)
    assert not (tmp_path / "other" / "attempt-1").exists()  # not retried: not a port clash
