"""A launch's processes stand or fall together; failed attempts are retried."""

from __future__ import annotations

import sys
import time

from loomax.launch.processes import Command, run_group, with_retries


def python(code: str) -> Command:
    return Command([sys.executable, "-c", code])


def test_all_succeed():
    assert run_group([python("pass"), python("pass")], poll=0.05) == 0


def test_one_failure_stops_the_others_and_gives_its_exit_code(tmp_path):
    marker = tmp_path / "survived"
    sleeper = python(f"import time, pathlib; time.sleep(30); pathlib.Path({str(marker)!r}).touch()")
    started = time.monotonic()
    code = run_group([sleeper, python("import sys; sys.exit(3)")], grace=1.0, poll=0.05)
    assert code == 3
    assert time.monotonic() - started < 20  # the sleeper was stopped, not waited for
    assert not marker.exists()


def test_sigterm_ignored_means_sigkill_after_the_grace():
    stubborn = python(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"
    )
    started = time.monotonic()
    assert run_group([stubborn, python("raise SystemExit(5)")], grace=0.5, poll=0.05) == 5
    assert time.monotonic() - started < 20


def test_retries_until_success_or_spent():
    calls = []
    assert with_retries(lambda k: calls.append(k) or (0 if k == 2 else 1), retries=3) == 0
    assert calls == [0, 1, 2]
    calls.clear()
    assert with_retries(lambda k: calls.append(k) or 7, retries=1) == 7
    assert calls == [0, 1]
