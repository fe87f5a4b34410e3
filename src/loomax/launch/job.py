"""The loomax command every process of a launch runs, and the environment they share."""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from loomax.launch.config import LaunchConfig
from loomax.tracking.git import COMMIT_ENV, git_info

_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


@dataclass(frozen=True)
class Job:
    """``args`` (a loomax command line, e.g. ``["train", "--config_path", ...]``) and ``env``."""

    args: list[str]
    env: dict[str, str]


def prepare_job(
    config: LaunchConfig, args: Sequence[str], environ: Mapping[str, str] | None = None
) -> Job:
    """The job of a launch: a train run gets a fixed run id (so retries resume it); the env
    is the forwarded variables, ``config.env`` and the launching repository's commit."""
    environ = os.environ if environ is None else environ
    args = list(args)
    if args and args[0] == "train" and not _names_run(args):
        args += ["--trainer.run_id", config.run_id or time.strftime("%Y%m%d-%H%M%S")]
    env = {name: environ[name] for name in config.forward_env if name in environ}
    env.update(config.env)
    commit = environ.get(COMMIT_ENV) or git_info().commit
    if commit:
        env.setdefault(COMMIT_ENV, commit)
    return Job(args, env)


def shell_command(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    pidfile: str | None = None,
) -> str:
    """``cd CWD && env K=V ... ARGV`` as one shell string (``~/`` in ``cwd`` is left to the shell).

    With ``pidfile``, a process an earlier attempt left running (its pid in that file, its
    command line naming loomax) is stopped first, and the command records its own pid there.
    """
    parts = []
    if cwd:
        parts.append(f"cd {quote_path(cwd)} &&")
    if pidfile:
        pid = shlex.quote(pidfile)
        parts.append(
            f"{{ p=$(cat {pid} 2>/dev/null) && grep -qa loomax /proc/$p/cmdline 2>/dev/null "
            f"&& kill $p && sleep 5; }}; echo $$ > {pid} && exec"
        )
    if env:
        parts.append("env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    parts.append(" ".join(shlex.quote(a) for a in argv))
    return " ".join(parts)


def mask_secrets(text: str, env: Mapping[str, str]) -> str:
    """``text`` with the values of secret-looking variables (API keys, tokens) replaced by ***."""
    for name, value in env.items():
        if value and any(word in name.upper() for word in _SECRET_WORDS):
            text = text.replace(shlex.quote(value), "***").replace(value, "***")
    return text


def quote_path(path: str) -> str:
    """``path`` quoted for a shell, leaving a leading ``~/`` for the shell to expand."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def _names_run(args: list[str]) -> bool:
    """Whether a train command line (or its config file) already names the run."""
    flags = ("--trainer.run_id", "--trainer.run_dir")
    if any(a in flags or a.startswith(tuple(f + "=" for f in flags)) for a in args):
        return True
    for i, arg in enumerate(args):
        if arg == "--config_path" and i + 1 < len(args):
            return _config_names_run(Path(args[i + 1]))
        if arg.startswith("--config_path="):
            return _config_names_run(Path(arg.split("=", 1)[1]))
    return False


class _AnyTagLoader(yaml.SafeLoader):
    """Reads a run YAML without following its ``!include`` tags."""


_AnyTagLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _config_names_run(path: Path) -> bool:
    try:
        data = yaml.load(path.read_text(), Loader=_AnyTagLoader) or {}
    except (OSError, yaml.YAMLError):
        return False
    trainer = data.get("trainer") if isinstance(data, dict) else None
    return isinstance(trainer, dict) and bool(trainer.get("run_id") or trainer.get("run_dir"))
