"""What draccus reads of a class to build its flags, read once per class, not once per parse.

Draccus builds every ``--section.field`` flag whenever it parses. For each flag it keeps
only the options its argparse action's constructor takes (``inspect.getfullargspec`` of the
action class: 7,920 times for a run's config, on a handful of argparse's own classes), and
for each section it resolves the dataclass's type hints (``typing.get_type_hints``: 140
times a parse, each evaluating every annotation's string). ``install`` gives draccus's field
and dataclass modules cached versions (the classes do not change once imported; draccus only
reads the hints), so the flags, and the parsed config, are the same: ``config/llama_8b.yaml``
with one flag parsed in 0.098-0.118 CPU-s against draccus alone's 0.185-0.206 (AMD EPYC,
2 cores, loaded; the signatures alone: 0.140), at every ``loomax`` command and every
``parse_config``.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing

from draccus.wrappers import dataclass_wrapper, field_wrapper


@functools.cache
def cached_argspec(action_class: type) -> inspect.FullArgSpec:
    """``inspect.getfullargspec`` of an argparse action class, once per class."""
    return inspect.getfullargspec(action_class)


@functools.cache
def cached_type_hints(cls: type) -> dict[str, typing.Any]:
    """``typing.get_type_hints`` of a config dataclass, once per class (read, never changed)."""
    return typing.get_type_hints(cls)


def install() -> bool:
    """Give draccus's field and dataclass modules the cached lookups; False (and nothing
    changed) when this draccus does not read them through those modules' ``inspect`` and
    ``typing`` attributes."""
    if getattr(field_wrapper, "inspect", None) is not inspect:
        return False
    if getattr(dataclass_wrapper, "typing", None) is not typing:
        return False
    field_wrapper.inspect = _Overlay(inspect, getfullargspec=cached_argspec)
    dataclass_wrapper.typing = _Overlay(typing, get_type_hints=cached_type_hints)
    return True


class _Overlay(types.SimpleNamespace):
    """A module with some functions replaced: every other attribute is the module's own."""

    def __init__(self, module: types.ModuleType, **replaced: typing.Any) -> None:
        super().__init__(**replaced)
        self._module = module

    def __getattr__(self, name: str) -> typing.Any:
        return getattr(self._module, name)
