"""`set_task_priority`: niceness that also holds against other sessions' processes."""

import json
import os

from loomax.data.token_cache import priority
from loomax.data.token_cache.priority import (
    DEFAULT_AUTOGROUP,
    autogroup_id,
    autogroup_nice,
    parse_autogroup,
)

CHILD = """
import json, os, sys
from loomax.data.token_cache.priority import autogroup_id, autogroup_nice, set_task_priority
driver = sys.argv[1] if sys.argv[1] != "self" else autogroup_id()
set_task_priority(10, driver)
first = (os.nice(0), autogroup_nice())
set_task_priority(0, driver)  # a plain task after a background one
print(json.dumps({"first": first, "then": (os.nice(0), autogroup_nice())}))
"""


def run_child(autogroups, driver: str) -> dict:
    """`CHILD` in a session (and autogroup) of its own, as a Ray node's worker runs."""
    return json.loads(autogroups.in_new_session(CHILD, driver))


def test_autogroup_text_parses_named_default_and_absent_groups():
    assert parse_autogroup("/autogroup-1285 nice 5") == ("/autogroup-1285", 5)
    # init's group (and a container's whose entry point never called setsid) reads empty
    assert parse_autogroup("") == (DEFAULT_AUTOGROUP, None)
    assert parse_autogroup(None) is None  # no autogroups in this kernel


def test_a_process_in_the_default_autogroup_has_an_id_but_no_nice(monkeypatch):
    """The driver's side of the last failed CI run: its group read empty and counted as "no
    autogroups", so no worker's group was niced."""
    monkeypatch.setattr(priority, "_autogroup_line", lambda pid="self": "")
    assert autogroup_id().endswith(f"/{DEFAULT_AUTOGROUP}")
    assert autogroup_nice() is None


def test_a_task_outside_the_drivers_autogroup_nices_its_group_then_restores_it(autogroups):
    driver_group = autogroup_nice()
    got = run_child(autogroups, autogroup_id() or "none")
    own = os.nice(0)
    if autogroup_id() is None:  # no autogroups: niceness alone
        assert got == {"first": [own + 10, None], "then": [own + 10, None]}
    elif autogroups.group_nice_settable():
        assert got == {"first": [own + 10, 10], "then": [own + 10, 0]}
    else:  # the kernel refuses: the process's own niceness still holds
        assert got == {"first": [own + 10, 0], "then": [own + 10, 0]}
    assert autogroup_nice() == driver_group  # the driver's group is never touched


def test_a_driver_in_the_default_autogroup_still_has_the_task_nice_its_own_group(autogroups):
    """A CI container's entry point never calls setsid: the driver sits in the kernel's default
    group (its /proc file reads empty), and a Ray node's worker in its own session is still
    niced. (The last CI run showed this: the workers' groups stayed at 0.)"""
    if autogroup_id() is None:
        return  # no autogroups: covered above
    boot = autogroup_id().rsplit("/", 1)[0]
    got = run_child(autogroups, f"{boot}/{DEFAULT_AUTOGROUP}")
    group = 10 if autogroups.group_nice_settable() else 0
    assert got == {"first": [os.nice(0) + 10, group], "then": [os.nice(0) + 10, 0]}


def test_a_task_in_the_drivers_autogroup_leaves_the_group_alone(autogroups):
    """A local Ray started by the training process shares its session: niceness inside the
    group already works, and niceing the group would slow the training process too."""
    got = run_child(autogroups, "self")
    group = None if autogroup_id() is None else 0  # the child's own new group, untouched
    assert got == {"first": [os.nice(0) + 10, group], "then": [os.nice(0) + 10, group]}
