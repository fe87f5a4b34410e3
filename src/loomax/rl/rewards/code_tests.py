"""``code_tests``: the fraction of unit tests a generated Python program passes.

The answer holds the tests (Python ``assert`` lines, one a line); the completion is the
program. Each test runs after the program in a fresh ``python -I`` subprocess, with a time
limit (``TIME_LIMIT_S``): a program that hangs or crashes fails that test, it never stops the
run. The subprocess is isolated from the environment and the user's site packages, not a
security sandbox: run untrusted code inside a container.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from loomax.rl.rewards.registry import register_reward

TIME_LIMIT_S = 5.0
"""Seconds a program and one test may run."""


def run_test(program: str, test: str, time_limit: float = TIME_LIMIT_S) -> bool:
    """Whether ``program`` followed by ``test`` exits 0 within ``time_limit`` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "candidate.py"
        path.write_text(program + "\n" + test + "\n")
        try:
            done = subprocess.run(
                [sys.executable, "-I", str(path)],
                cwd=tmp,
                capture_output=True,
                timeout=time_limit,
                env={},
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


@register_reward("code_tests")
def code_tests(prompt: str, completion: str, answer: str | None) -> float:
    """The fraction of the answer's ``assert`` lines the completion's program passes."""
    tests = [line for line in (answer or "").splitlines() if line.strip()]
    if not tests:
        return 0.0
    return sum(run_test(completion, t) for t in tests) / len(tests)
