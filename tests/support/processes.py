"""Subprocesses of one test scenario: started in their own process groups, killed together.

`Processes.start` runs a command with stdout and stderr going to files (no pipe can fill
up and stall a child while the test waits on a sibling). When one child fails, `wait` and
`check_running` raise with that child's stderr tail, and `kill_all` (also on `__exit__`)
kills every child's whole process group. `run_scenario` reruns a scenario once when a
child failed because a port picked for it was taken meanwhile ("address in use").
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ADDRESS_IN_USE = re.compile(r"address already in use|EADDRINUSE|failed to add port", re.I)
"""How a child says that the port it was given was taken by someone else meanwhile."""


class ChildFailed(AssertionError):
    """A child process exited with an error (its stderr tail is in the message)."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


class Processes:
    """The children of one scenario, their output in `directory/<name>.out|.err`."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill_all()

    def start(self, name: str, args: Sequence[str], env: dict | None = None) -> subprocess.Popen:
        """Starts `args` as child `name` in a new process group."""
        with open(self.directory / f"{name}.out", "wb") as out:
            with open(self.directory / f"{name}.err", "wb") as err:
                child = subprocess.Popen(
                    list(args), env=env, stdout=out, stderr=err, start_new_session=True
                )
        self.children[name] = child
        return child

    def stdout(self, name: str) -> str:
        return (self.directory / f"{name}.out").read_text(errors="replace")

    def stderr(self, name: str) -> str:
        return (self.directory / f"{name}.err").read_text(errors="replace")

    def check_running(self) -> None:
        """Raises `ChildFailed` if any child has exited (a scenario expects them all up)."""
        for name, child in self.children.items():
            if child.poll() is not None:
                self._fail(name, f"exited early with code {child.returncode}")

    def wait(self, timeout: float) -> dict[str, str]:
        """Waits for every child to exit 0 within `timeout` seconds; returns their stdout.

        The first child to fail (or the ones still running at the deadline) fails the test,
        with its stderr; the others are killed at once rather than left running.
        """
        deadline = time.monotonic() + timeout
        pending = dict(self.children)
        while pending:
            for name, child in list(pending.items()):
                if child.poll() is None:
                    continue
                del pending[name]
                if child.returncode != 0:
                    self._fail(name, f"exited with code {child.returncode}")
            if pending and time.monotonic() > deadline:
                self._fail(next(iter(pending)), f"still running after {timeout:.0f}s")
            time.sleep(0.05)
        return {name: self.stdout(name) for name in self.children}

    def kill_all(self) -> None:
        """Kills the process group of every child that is still running, and reaps them."""
        for child in self.children.values():
            if child.poll() is None:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for child in self.children.values():
            child.wait(timeout=30)

    def address_in_use(self) -> bool:
        """Whether any child said that its port was taken."""
        return any(ADDRESS_IN_USE.search(self.stderr(name)) for name in self.children)

    def _fail(self, name: str, what: str) -> None:
        self.kill_all()
        stderr = self.stderr(name)
        raise ChildFailed(f"child {name!r} {what}; its stderr ends:\n{stderr[-4000:]}", stderr)


def run_scenario(directory: Path, scenario: Callable[[Processes], T], attempts: int = 2) -> T:
    """Runs `scenario` with fresh `Processes` (under `directory/attempt-<n>`), killing its
    children when it ends; runs it again (up to `attempts` times) only when it failed
    because a port given to a child was taken meanwhile (bind-then-close port picking)."""
    for attempt in range(attempts):
        with Processes(Path(directory) / f"attempt-{attempt}") as processes:
            try:
                return scenario(processes)
            except Exception:
                processes.kill_all()
                if attempt + 1 == attempts or not processes.address_in_use():
                    raise
    raise AssertionError("unreachable")
