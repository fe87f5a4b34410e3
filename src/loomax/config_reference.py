"""Generate the configuration reference (Markdown) from the config dataclasses.

Each field's one-line doc is the string literal written right below it in the class
body. ``python -m loomax.config_reference docs/reference/config.md`` rewrites the page;
a test checks that the committed page is current and that every field has a doc.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from datetime import timedelta
from pathlib import Path

import draccus

from loomax.config import format_duration


def field_docs(cls: type) -> dict[str, str]:
    """``{field: doc}`` from the string literals following each field, over the class's MRO."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass.__module__.startswith("draccus"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for node, following in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                    docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def _type_name(tp) -> str:
    text = str(tp) if not isinstance(tp, type) else tp.__name__
    text = re.sub(r"\b(?:typing|datetime|loomax(?:\.\w+)*)\.(\w+)", r"\1", text)
    text = text.replace("NoneType", "null").replace("timedelta", "duration")
    return text.replace("|", "\\|")  # a bare | would split the Markdown table cell


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        name = _choice_name(type(value))
        return f"type: {name}" if name else "(section)"
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else repr(value).replace("'", "")


def _flow(value) -> str:
    """A dataclass as a YAML flow mapping: the fields off their defaults, else the set ones."""
    fields = dataclasses.fields(value)
    items = [
        (f.name, getattr(value, f.name)) for f in fields if getattr(value, f.name) != f.default
    ]
    items = items or [(f.name, getattr(value, f.name)) for f in fields]
    return "{" + ", ".join(f"{k}: {v}" for k, v in items if v is not None) + "}"


def _choice_name(cls: type) -> str | None:
    for base in cls.__mro__[1:]:
        if (
            isinstance(base, type)
            and issubclass(base, draccus.ChoiceRegistry)
            and base is not draccus.ChoiceRegistry
        ):
            try:
                return base.get_choice_name(cls)
            except (KeyError, ValueError, AttributeError):
                continue
    return None


def _section_types(tp) -> list[type]:
    args = typing.get_args(tp) or (tp,)
    found = []
    for arg in args:
        found.extend(
            t
            for t in (typing.get_args(arg) or (arg,))
            if isinstance(t, type) and dataclasses.is_dataclass(t)
        )
    return found


def registry_members(cls: type) -> list[tuple[str, type]]:
    """The built-in choices of a registry (types users or tests register elsewhere, and removed ones kept only to say how to migrate, are not documented here)."""
    if issubclass(cls, draccus.ChoiceRegistry):
        known = cls.get_known_choices().items()
        return sorted(
            (name, c)
            for name, c in known
            if c.__module__.startswith("loomax.") and not getattr(c, "removed", False)
        )
    return []


def render(root: type, title: str = "Configuration reference") -> str:
    """Markdown for ``root`` and every section below it."""
    out = [
        f"# {title}",
        "",
        "Generated from the config dataclasses by `python -m loomax.config_reference`; do not edit.",
        "Every key can be set in the run YAML or overridden as `--section.key value`.",
        "",
    ]
    _render_class(root, "", out, seen=set())
    return "\n".join(out).rstrip() + "\n"


def _render_class(cls: type, prefix: str, out: list[str], seen: set) -> None:
    key = (cls, prefix)
    if key in seen:
        return
    seen.add(key)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    heading = f"`{prefix}`" if prefix else "Top level"
    choice = _choice_name(cls)
    out += [f"## {heading}" + (f" (`type: {choice}`)" if choice else ""), ""]
    if cls.__doc__:
        out += [" ".join(cls.__doc__.split()), ""]
    out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    nested: list[tuple[str, type]] = []
    for field in dataclasses.fields(cls):
        if field.name.startswith("_"):
            continue
        tp = hints.get(field.name, field.type)
        out.append(
            f"| `{field.name}` | `{_type_name(tp)}` | `{_default(field)}` | {docs.get(field.name, '')} |"
        )
        for sub in _section_types(tp):
            members = registry_members(sub) or [(None, sub)]
            for _, member in members:
                nested.append((f"{prefix}.{field.name}" if prefix else field.name, member))
    out.append("")
    for sub_prefix, member in nested:
        _render_class(member, sub_prefix, out, seen)


def undocumented(root: type) -> list[str]:
    """``section.field`` names of public fields without a doc line."""
    missing: list[str] = []

    def walk(cls, prefix, seen):
        if cls in seen:
            return
        seen.add(cls)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.name.startswith("_"):
                continue
            name = f"{prefix}.{field.name}" if prefix else field.name
            if not docs.get(field.name):
                missing.append(f"{cls.__name__}.{field.name}")
            for sub in _section_types(hints.get(field.name, field.type)):
                for _, member in registry_members(sub) or [(None, sub)]:
                    walk(member, name, seen)

    walk(root, "", set())
    return missing


def render_reference() -> str:
    """The committed reference: ``TrainLmConfig`` (``loomax train``), then the sections other
    run commands add to the same ``model``, ``optimizer`` and ``trainer`` (``loomax dpo``'s
    ``dpo``, ``loomax rl``'s ``rl``)."""
    from loomax.dpo.config import TrainDpoConfig
    from loomax.lm import TrainLmConfig
    from loomax.rl.config import TrainRlConfig

    out = [render(TrainLmConfig).rstrip(), ""]
    for command, what, cls, section in (
        ("dpo", "A DPO run", TrainDpoConfig, "dpo"),
        ("rl", "An RL run", TrainRlConfig, "rl"),
    ):
        out += [
            f"# `loomax {command}`",
            "",
            f"{what} (`{cls.__name__}`) has the `model`, `optimizer` and `trainer` sections above "
            f"and, in place of `data` and `sample`, a `{section}` section "
            "([Post-training](../post_training.md)).",
            "",
        ]
        field = next(f for f in dataclasses.fields(cls) if f.name == section)
        _render_class(typing.get_type_hints(cls)[field.name], section, out, seen=set())
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    """Write the reference (``render_reference``) to the path given (stdout if none)."""
    argv = sys.argv[1:] if argv is None else argv
    text = render_reference()
    if argv:
        Path(argv[0]).parent.mkdir(parents=True, exist_ok=True)
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
