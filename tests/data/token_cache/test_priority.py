"""`set_task_priority`: niceness that also holds against other sessions' processes."""

import json
import os
import subprocess
import sys

from loomax.data.token_cache.priority import autogroup_id, autogroup_nice

CHILD = """
import json, os, sys
from loomax.data.token_cache.priority import autogroup_id, autogroup_nice, set_task_priority
driver = sys.argv[1] if sys.argv[1] != "self" else autogroup_id()
set_task_priority(10, driver)
first = (os.nice(0), autogroup_nice())
set_task_priority(0, driver)  # a plain task after a background one
print(json.dumps({"first": first, "then": (os.nice(0), autogroup_nice())}))
"""


def run_child(driver: str) -> dict:
    """`CHILD` in a session (and autogroup) of its own, as a Ray node's worker runs."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, driver],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
    )
    return json.loads(out.stdout)


def test_a_task_outside_the_drivers_autogroup_nices_its_group_then_restores_it():
    got = run_child(autogroup_id() or "none")
    own = os.nice(0)
    if autogroup_id() is None:  # no autogroups: niceness alone
        assert got == {"first": [own + 10, None], "then": [own + 10, None]}
    else:
        assert got == {"first": [own + 10, 10], "then": [own + 10, 0]}
        assert autogroup_nice() == 0  # this (the driver's) group is never touched


def test_a_task_in_the_drivers_autogroup_leaves_the_group_alone():
    """A local Ray started by the training process shares its session: niceness inside the
    group already works, and niceing the group would slow the training process too."""
    got = run_child("self")
    group = None if autogroup_id() is None else 0
    assert got == {"first": [os.nice(0) + 10, group], "then": [os.nice(0) + 10, group]}
