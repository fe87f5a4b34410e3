"""Running code in an autogroup of its own, and asking what this kernel allows there."""

import functools
import subprocess
import sys

PROBE = """
from pathlib import Path
from loomax.data.token_cache.priority import autogroup_nice
try:
    Path("/proc/self/autogroup").write_text("1")
except OSError:
    pass
print(autogroup_nice())
"""


def in_new_session(code: str, *args: str) -> str:
    """`code`'s output, run in a session (and autogroup) of its own, as a Ray node's worker."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
    )
    return out.stdout


@functools.cache
def group_nice_settable() -> bool:
    """Whether this kernel lets a session's process set its own autogroup's nice value."""
    return in_new_session(PROBE).strip() == "1"
