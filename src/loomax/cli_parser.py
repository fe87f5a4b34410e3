"""The argument parsing every ``loomax`` command shares: one-line errors, config overrides.

``command_parser`` makes a command's ``argparse`` parser whose errors are ``UserError``s
and whose usage ends with ``[--section.field VALUE ...]``; ``load_config`` parses a run
config from ``--config_path`` and the leftover flags, turning draccus' exits into
``UserError``s too (config errors are ``ConfigError``s, ``UserError``s already);
``given_values`` says which keys the file and the flags set (the rest keep their defaults);
``steps_line`` is the last line every training command prints.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Any

from loomax.config import expand_overlays, parse_config
from loomax.config_suggest import unknown_flags_hint
from loomax.errors import UserError

CONFIG_EPILOG = (
    "config: --config_path FILE reads a run YAML; any key can be set or overridden with\n"
    "--section.field VALUE (e.g. --trainer.num_train_steps 100 --model.type llama), or by\n"
    "--overlay FILE, a YAML file of keys (such as `loomax plan` writes); later flags win.\n"
    "Every key is listed in docs/reference/config.md."
)


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are ``UserError``s (printed in one line by ``main``).

    With ``overrides`` set, the usage ends with ``[--section.field VALUE ...]``: the flags
    left over by ``parse_known_args`` go to the config.
    """

    overrides = False

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message)

    def format_usage(self) -> str:
        return self._add_overrides(super().format_usage())

    def format_help(self) -> str:
        return self._add_overrides(super().format_help())

    def _add_overrides(self, text: str) -> str:
        if not self.overrides:
            return text
        usage, blank, rest = text.partition("\n\n")
        indent = " " * len(f"usage: {self.prog} ")
        usage = f"{usage.rstrip()}\n{indent}[--section.field VALUE ...]"
        return f"{usage}{blank}{rest}" if blank else usage + "\n"


def command_parser(prog: str, description: str, *, config: bool = False) -> CommandParser:
    """The parser of ``loomax <prog>``; ``config`` adds ``--config_path`` and the overrides help."""
    parser = CommandParser(
        prog=f"loomax {prog}",
        description=description,
        epilog=CONFIG_EPILOG if config else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    if config:
        parser.overrides = True
        parser.add_argument("--config_path", metavar="FILE", help="the run's YAML config")
    return parser


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """Turn draccus' usage exit (an unknown flag) into a one-line ``UserError``.

    Config errors are ``ConfigError``s (``UserError``s) already; any other exception
    passes through unchanged, as the bug it is.
    """
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    except SystemExit as e:  # draccus' argparse printed its usage and an error line
        if e.code in (0, None):
            raise
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        message = lines[-1].split(": error: ", 1)[-1] if lines else "bad command line"
        raise UserError(message) from None
    except UserError:
        raise
    except BaseException:
        sys.stderr.write(captured.getvalue())  # what came before a bug may help find it
        raise
    else:
        sys.stderr.write(captured.getvalue())


def load_config(cls: type, config_path: str | None, overrides: list[str]):
    """``parse_config`` whose errors (draccus' unknown flags included) are one-line
    ``UserError``s; an unknown flag's names the nearest valid one."""
    try:
        with config_errors():
            return parse_config(cls, config_path, overrides)
    except UserError as e:
        message = str(e)
        if not message.startswith("unrecognized arguments:"):
            raise
        raise UserError(message + unknown_flags_hint(cls, message)) from None


def given_values(
    cls: type, config_path: str | None, overrides: list[str]
) -> dict[tuple[str, ...], Any]:
    """The key paths the YAML file (``!include``s followed) and the flags (``--overlay``
    files expanded; later flags win) set, e.g. ``("model", "hidden_dim")``, with their
    values as written (a flag's as its text); a key set to a mapping gives its leaves. A file
    that cannot be read gives nothing here: ``parse_config`` reports it."""
    import yaml
    from draccus import cfgparsing

    out: dict[tuple[str, ...], Any] = {}

    def walk(prefix: tuple[str, ...], node: Any) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk((*prefix, str(key)), value)
        elif prefix:
            out[prefix] = node

    if config_path is not None:
        try:
            with open(config_path, encoding="utf-8") as f:
                walk((), cfgparsing.load_config(f, file=config_path))
        except Exception:  # noqa: BLE001 - any problem of the file: parse_config names it
            pass
    args = expand_overlays(cls, overrides)
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        try:
            parsed = yaml.safe_load(value) if value.lstrip().startswith("{") else value
        except yaml.YAMLError:
            parsed = value
        walk(tuple(name.split(".")), parsed)
    return out


def steps_line(step: int, num_train_steps: int | None, stop_reason: str | None) -> str:
    """The run's last line: how many steps ran, and what stopped it early if something did."""
    line = f"steps: {step} of {num_train_steps}"
    if stop_reason is None:
        return line
    if stop_reason == "trainer.eval_only":
        return f"{line} (trainer.eval_only: evaluated, not trained)"
    if stop_reason.startswith("trainer.max_train_time"):
        return (
            f"{line}, stopped early by the time guard: {stop_reason} (a slower or busier machine; "
            "the evals and the sample above are of step "
            f"{step}; --trainer.max_train_time null trains every step, docs/quickstart.md)"
        )
    return f"{line}, stopped early: {stop_reason}"
