"""Draccus glue: load a run YAML (with ``!include``), apply CLI overrides, report errors.

Every config class is a frozen dataclass. Sections with several implementations are
``draccus.ChoiceRegistry`` subclasses selected by a ``type:`` key. This module only knows
how to parse; it never imports the sections themselves (they sit above it in the stack).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import draccus
import yaml
from draccus.utils import DecodingError, ParsingError

from loomax import config_help, config_parse_cache
from loomax.config_suggest import did_you_mean, unknown_keys_hint
from loomax.errors import UserError

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "format_duration",
    "overlay_args",
    "parse_config",
    "parse_duration",
    "to_yaml",
]


class ConfigError(UserError, ValueError):
    """A run configuration that cannot be used; the message names key, file and line."""


# --------------------------------------------------------------------------- durations

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")


def parse_duration(value: str | int | float | timedelta) -> timedelta:
    """Parse ``"90s"``, ``"15m"``, ``"1h30m"``, ``"2d"`` or a number of seconds."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '15m' or '1h', got {value!r}")
    if isinstance(value, int | float):
        return timedelta(seconds=float(value))
    text = str(value).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return timedelta(seconds=float(text))
    pos, seconds = 0, 0.0
    for match in _DURATION_RE.finditer(text):
        if match.start() != pos and text[pos : match.start()].strip():
            break
        seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos == 0 or text[pos:].strip():
        raise ValueError(f"expected a duration like '90s', '15m', '1h' or '1h30m', got {value!r}")
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    """The shortest ``"1h30m"``-style spelling of ``value``."""
    total = value.total_seconds()
    if total != int(total):
        return f"{total}s"
    total, out = int(total), ""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if total >= size:
            out += f"{total // size}{unit}"
            total %= size
    return out or "0s"


def _decode_duration(raw_value: object, path: Sequence[str]) -> timedelta:
    try:
        return parse_duration(raw_value)  # type: ignore[arg-type]
    except ValueError as e:
        raise DecodingError(path, str(e)) from e


draccus.decode.register(timedelta, _decode_duration)
draccus.encode.register(timedelta, format_duration)
config_help.install()  # every flag's help text in one pass per class, not one per field
config_parse_cache.install()  # draccus's per-class lookups once, not once per flag


# --------------------------------------------------------------------------- parsing


def parse_config(
    cls: type[T], config_path: str | os.PathLike | None, args: Sequence[str] = ()
) -> T:
    """Build ``cls`` from a YAML file plus ``--section.field value`` overrides.

    ``--overlay FILE`` among the overrides sets the keys of that YAML file there, so flags
    after it win (see ``overlay_args``). Raises ``ConfigError`` naming the offending key and where it came from (the file and
    line, or the command line). Unknown command-line flags make draccus exit with code 2.
    """
    given, args = list(args), expand_overlays(cls, args)
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        _check_includes(path)
    try:
        return draccus.parse(config_class=cls, config_path=config_path, args=args)
    except DecodingError as e:
        raise ConfigError(_describe_decoding_error(e, cls, config_path, args)) from e
    except ParsingError as e:
        cause = e.__cause__
        where = f" (config {config_path})" if config_path else ""
        if isinstance(cause, ValueError):  # a section's own check: its message names the key
            raise ConfigError(_describe_check_error(str(cause), cls, config_path, given)) from e
        detail = f": {cause}" if cause else ""
        raise ConfigError(f"{e}{where}{detail}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {config_path}: {e}") from e


def expand_overlays(cls: type, args: Sequence[str]) -> list[str]:
    """``args`` with each ``--overlay FILE`` replaced by that file's keys as flags, in place."""
    out: list[str] = []
    items = iter(args)
    for arg in items:
        if arg == "--overlay":
            path = next(items, None)
            if path is None:
                raise ConfigError("--overlay needs a FILE (a YAML file of config keys)")
            out += overlay_args(cls, path)
        elif arg.startswith("--overlay="):
            out += overlay_args(cls, arg.removeprefix("--overlay="))
        else:
            out.append(arg)
    return out


def overlay_args(cls: type, path: str | os.PathLike) -> list[str]:
    """The keys of the YAML overlay at ``path`` as ``--section.field value`` flags of ``cls``.

    An overlay is a partial run config (``trainer: {mesh: {data: 8}}``): nested sections
    become dotted flags; a scalar, a list or a mapping-valued field becomes one flag (lists
    and mappings as JSON). Raises ``ConfigError`` naming the file and line of a key ``cls``
    does not have, before anything is parsed.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"overlay file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in overlay {path}: {e}") from e
    if data is None:
        return []
    out: list[str] = []

    def where(keys: list[str]) -> str:
        located = locate_key(path, keys)
        return f"overlay {path}, line {located[1]}" if located else f"overlay {path}"

    def walk(node_cls: type | None, node: Any, keys: list[str]) -> None:
        if not isinstance(node, dict):
            raise ConfigError(f"{where(keys)}: `{'.'.join(keys)}` must be a mapping of keys")
        fields = _section_fields(node_cls)
        for key, value in node.items():
            key = str(key)
            if fields is not None and key not in fields:
                raise ConfigError(
                    f"{where([*keys, key])}: `{'.'.join([*keys, key])}` is not a config key"
                    f"{did_you_mean(key, fields, keys)} (keys of {'.'.join(keys) or 'the run'}: {', '.join(sorted(fields))})"
                )
            section = fields[key] if fields is not None else None
            if isinstance(value, dict) and (section is not None or fields is None):
                walk(section, value, [*keys, key])
            else:
                out.extend([f"--{'.'.join([*keys, key])}", _flag_value(value)])

    walk(cls, data, [])
    return out


def _section_fields(cls: type | None) -> dict[str, type | None] | None:
    """Field name -> the field's dataclass type (None for other types) of dataclass ``cls``;
    None when the fields cannot be known here (a choice section picked by its ``type``)."""
    if cls is None or not dataclasses.is_dataclass(cls) or issubclass(cls, draccus.ChoiceRegistry):
        return None
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: let draccus check the keys
        return None
    out: dict[str, type | None] = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        out[f.name] = hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None
    return out


def _flag_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)


def to_yaml(config: object) -> str:
    """The config as YAML, in the form ``parse_config`` reads back."""
    return draccus.dump(config)


def to_json_dict(config: object) -> dict[str, Any]:
    """The config as plain JSON values (nested dicts; durations and the like as strings)."""
    return json.loads(json.dumps(yaml.safe_load(to_yaml(config)), default=str))


def flatten_config(config: object) -> dict[str, Any]:
    """The config as one level of dotted keys (``trainer.seed``), e.g. for trackers' hyperparameters."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", to_json_dict(config))
    return out


def _describe_decoding_error(e: DecodingError, cls: type, config_path, args: Sequence[str]) -> str:
    key_path = list(e.key_path)
    invalid = re.findall(r"`([^`]+)`", e.message) if "are not valid" in e.message else []
    full_key = ".".join(key_path + invalid[:1])
    shown = ".".join(key_path) or "<top level>"
    message = f"config key `{shown}`: {e.message}{unknown_keys_hint(e.message, cls, key_path)}"
    if isinstance(e.__cause__ or e.__context__, UserError):  # its own message says it all
        message = str(e.__cause__ or e.__context__)
    flag = f"--{'.'.join(key_path)}"
    if any(a == flag or a.startswith(flag + "=") for a in args):
        return f"{message} (from the command line flag {flag})"
    if config_path is not None:
        located = locate_key(Path(config_path), full_key.split(".")) or locate_key(
            Path(config_path), key_path
        )
        if located is not None:
            file, line = located
            return f"{message} ({file}, line {line})"
        return f"{message} (config {config_path})"
    return message


_DOTTED_KEY = re.compile(r"(?<![\w./\\-])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
"""A dotted name such as ``model.hidden_dim`` (not part of a path such as ``conf/run.yaml``)."""


def _describe_check_error(message: str, cls: type, config_path, args: Sequence[str]) -> str:
    """``message`` of a section's own check, with where the keys it names were set: the file
    and line (``!include``s followed), an ``--overlay`` file and line, or the command line."""
    sources: list[tuple[str, str]] = []
    for keys in _named_keys(message, cls):
        where = _key_source(keys, config_path, args)
        if where is not None:
            sources.append((".".join(keys), where))
    if not sources:
        return f"{message} (config {config_path})" if config_path else message
    if len(sources) == 1:
        return f"{message} ({sources[0][1]})"
    return f"{message} ({'; '.join(f'{key}: {where}' for key, where in sources)})"


def _named_keys(message: str, cls: type) -> list[list[str]]:
    """The config keys of ``cls`` that ``message`` names (``model.hidden_dim``), in order; a
    leading name that is not a section (``ladder.sizes``) is dropped."""
    top = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    out: list[list[str]] = []
    for match in _DOTTED_KEY.finditer(message):
        keys = match.group().split(".")
        if keys[0] not in top and keys[1] in top:
            keys = keys[1:]
        if keys[0] in top and keys not in out:
            out.append(keys)
    return out


def _key_source(keys: list[str], config_path, args: Sequence[str]) -> str | None:
    """Where the value of ``keys`` was set last: a flag or an ``--overlay`` in ``args``, else
    the config file; None when it keeps its default."""
    where = None
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if name == "overlay":
            path = value if eq else (args[i + 1] if i + 1 < len(args) else None)
            located = locate_key(Path(path), keys, exact=True) if path else None
            if located is not None:
                where = f"overlay {located[0]}, line {located[1]}"
        else:
            flag = name.split(".")
            n = min(len(flag), len(keys))
            if flag[:n] == keys[:n]:  # the key itself, a part of it, or its section
                where = f"from the command line flag --{name}"
    if where is None and config_path is not None:
        located = locate_key(Path(config_path), keys, exact=True)
        if located is not None:
            where = f"{located[0]}, line {located[1]}"
    return where


# --------------------------------------------------------------------------- YAML locations


class _ComposeLoader(yaml.SafeLoader):
    """A loader used only to compose nodes (with positions) for error messages."""


def _compose(path: Path) -> yaml.Node | None:
    with open(path, encoding="utf-8") as f:
        loader = _ComposeLoader(f)
        try:
            return loader.get_single_node()
        finally:
            loader.dispose()


def _check_includes(path: Path, seen: tuple[Path, ...] = ()) -> None:
    """Fail early, naming file and line, on an ``!include`` of a missing file."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: !include cycle through {' -> '.join(map(str, seen))}")
    try:
        root = _compose(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {path}: {e}") from e
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.ScalarNode) and node.tag == "!include":
            target = (path.parent / node.value).resolve()
            if not target.is_file():
                raise ConfigError(
                    f"{path}, line {node.start_mark.line + 1}: !include of missing file {target}"
                )
            _check_includes(target, (*seen, path.resolve()))
        elif isinstance(node, yaml.MappingNode):
            stack.extend(v for _, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


def locate_key(
    path: Path, key_path: Sequence[str], *, exact: bool = False
) -> tuple[Path, int] | None:
    """The file and 1-based line where ``key_path`` is set, following ``!include``.

    A key that is not there gives the line of its deepest section that is, or None with
    ``exact``.
    """
    try:
        node = _compose(path)
    except (OSError, yaml.YAMLError):
        return None
    file, line, found = path, None, 0
    for key in key_path:
        if isinstance(node, yaml.ScalarNode) and node.tag == "!include":
            file = (file.parent / node.value).resolve()
            try:
                node = _compose(file)
            except (OSError, yaml.YAMLError):
                return None
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if key_node.value == key:
                line, node, found = key_node.start_mark.line + 1, value_node, found + 1
                break
        else:
            break
    if line is None or (exact and found < len(key_path)):
        return None
    return file, line


def import_package_modules(package: str, path: Sequence[str]) -> None:
    """Import every module of ``package`` (its ``__name__`` and ``__path__``), so that each one's
    choices register (``@register_subclass``, ``@hook_type``) with no list of them anywhere:
    a new model family, hook or optimizer is one new file."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")
