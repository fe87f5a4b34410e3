"""The nearest valid name for a misspelled config key, flag or ``type``: "did you mean ...?".

``config.parse_config`` and ``cli_parser.load_config`` add these hints to their one-line
errors. Names are matched with ``difflib`` (similar spelling, not meaning); a name with no
close match gets no hint.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterable, Sequence

import draccus


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate spelled most like ``name``, or None when none is close."""
    matches = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str], section: Sequence[str] = ()) -> str:
    """ " (did you mean `section.nearest`?)", or "" when no candidate is close to ``name``."""
    match = nearest(name, candidates)
    return f" (did you mean `{'.'.join([*section, match])}`?)" if match else ""


def section_class(cls: type, keys: Sequence[str], class_name: str | None = None) -> type | None:
    """The dataclass reached from ``cls`` through the fields ``keys`` (a list's index, such as
    the ``0`` of ``trainer.hooks.0``, stands for its items); a choice section (a
    ``draccus.ChoiceRegistry``) is resolved to its choice named ``class_name`` when given."""
    node: type | None = cls
    for key in keys:
        if node is None:
            return None
        if key.isdigit():
            continue
        node = _field_types(node, lists=True).get(key)
    if node is not None and class_name and node.__name__ != class_name:
        node = next((c for c in _choices(node) if c.__name__ == class_name), node)
    return node


def unknown_keys_hint(message: str, cls: type, key_path: Sequence[str]) -> str:
    """ " (did you mean `trainer.num_train_steps`?)" for draccus' "The fields `x` are not
    valid for Class" or "Couldn't find a choice class for 'x'" at ``key_path``; else ""."""
    prefix = re.sub(r"\.(\d+)\b", r"[\1]", ".".join(key_path))
    prefix = prefix + "." if prefix else ""
    found = re.search(r"are not valid for (\w+)", message)
    if found:
        section = section_class(cls, key_path, found.group(1))
        fields = list(_field_types(section)) if section is not None else []
        bad = re.findall(r"`([^`]+)`", message.split(" are not valid")[0])
        hints = [f"`{prefix}{n}`" for b in bad if (n := nearest(b, fields))]
        return f" (did you mean {' and '.join(hints)}?)" if hints else ""
    found = re.search(r"Couldn't find a choice class for '([^']*)'", message)
    if found:
        section = section_class(cls, key_path)
        known = sorted(_choice_names(section)) if section is not None else []
        if not known:
            return ""
        name = nearest(found.group(1), known)
        hint = f"did you mean `{name}`? " if name else ""
        return f" ({hint}{prefix}type is one of: {', '.join(known)})"
    return ""


def unknown_flags_hint(cls: type, message: str) -> str:
    """For argparse's "unrecognized arguments: --trainer.num_train_step 5": each unknown
    flag's nearest valid one, " (did you mean --trainer.num_train_steps?)"; else ""."""
    flags = [
        word.split("=", 1)[0][2:]
        for word in message.removeprefix("unrecognized arguments:").split()
        if word.startswith("--")
    ]
    hints = [f"--{match}" for flag in flags if (match := nearest_key(cls, flag.split(".")))]
    return f" (did you mean {' and '.join(hints)}?)" if hints else ""


def nearest_key(cls: type, keys: Sequence[str]) -> str | None:
    """The valid dotted key nearest ``keys``, one part at a time (a choice section offers
    the keys of all its choices); None when a part has no close match."""
    level: list[type] = [cls]
    out = []
    for key in keys:
        fields: dict[str, type | None] = {}
        for section in level:
            if _choice_names(section):
                fields["type"] = None  # a choice section's `type` picks the choice
            for choice in _choices(section):
                for name, hint in _field_types(choice).items():
                    fields.setdefault(name, hint)
        name = key if key in fields else nearest(key, fields)
        if name is None:
            return None
        out.append(name)
        level = [fields[name]] if fields[name] is not None else []
    return ".".join(out)


def _choices(cls: type) -> list[type]:
    """``cls``'s registered choices if it is a choice section with any, else ``[cls]``."""
    if isinstance(cls, type) and issubclass(cls, draccus.ChoiceRegistry):
        known = [c for c in cls.get_known_choices().values() if isinstance(c, type)]
        if known:
            return known
    return [cls]


def _choice_names(cls: type) -> list[str]:
    if isinstance(cls, type) and issubclass(cls, draccus.ChoiceRegistry):
        return list(cls.get_known_choices())
    return []


def _field_types(cls: type | None, lists: bool = False) -> dict[str, type | None]:
    """Field name -> the dataclass it holds (``X``, ``X | None``, with ``lists`` also
    ``list[X]``), else None; {} for a non-dataclass."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return {}
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: names only
        hints = {}
    return {
        f.name: _dataclass_in(hints.get(f.name), lists) for f in dataclasses.fields(cls) if f.init
    }


def _dataclass_in(hint: object, lists: bool) -> type | None:
    """The dataclass ``hint`` is, or is optional of (``X | None``), or with ``lists`` a list
    of; else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        args = tuple(a for a in args if a is not type(None))
    elif not (lists and origin is list):
        return None
    if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None
