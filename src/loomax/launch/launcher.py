"""``loomax launch``: parse the options, then start (or print) the command on the target."""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from loomax.distributed.net import free_port
from loomax.launch.config import LaunchConfig, LaunchError
from loomax.launch.docker import build_and_push
from loomax.launch.gpu import check_ssh_identity, gpu_commands, gpu_hosts
from loomax.launch.job import Job, mask_secrets, prepare_job
from loomax.launch.local import local_commands
from loomax.launch.processes import Command, run_group, with_retries
from loomax.launch.slurm import render_sbatch, sbatch_path
from loomax.launch.tpu import ensure_tpu_vm, recreate_plan, tpu_command

logger = logging.getLogger(__name__)

DEFAULTS_FILE = ".loomax.yaml"
_BOOL_FLAGS = ("dry_run", "docker_build", "spot")
_TOOLS = {"gpu": "ssh", "slurm": "sbatch", "tpu": "gcloud"}


def split_launch_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[launch options] -- <loomax command>`` -> (options, command); raises ``LaunchError``."""
    argv = list(argv)
    if "--" not in argv:
        raise LaunchError("missing `-- <loomax command>`, e.g. `-- train --config_path FILE`")
    i = argv.index("--")
    options, command = argv[:i], argv[i + 1 :]
    if not command:
        raise LaunchError("nothing to run after `--`")
    normalized: list[str] = []
    for k, arg in enumerate(options):
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            arg = "--" + name.replace("-", "_") + eq + value
            following = options[k + 1] if k + 1 < len(options) else None
            if (
                name.replace("-", "_") in _BOOL_FLAGS
                and not eq
                and (following is None or following.startswith("--"))
            ):
                normalized += [arg, "true"]
                continue
        normalized.append(arg)
    return normalized, command


def defaults_file(options: list[str]) -> tuple[str | None, list[str]]:
    """``--launch_config PATH`` if given, else ``.loomax.yaml`` here if it exists."""
    if "--launch_config" in options:
        i = options.index("--launch_config")
        if i + 1 >= len(options):
            raise LaunchError("--launch_config needs a path")
        return options[i + 1], options[:i] + options[i + 2 :]
    return (DEFAULTS_FILE if Path(DEFAULTS_FILE).is_file() else None), options


def launch(config: LaunchConfig, args: Sequence[str], *, out: TextIO | None = None) -> int:
    """Start ``loomax <args>`` on ``config.target`` (or print it all with ``dry_run``); the exit code."""
    out = out or sys.stdout
    check_inputs(config)
    job = prepare_job(config, args)
    if config.dry_run:
        lines = plan(config, job)
        print(f"# loomax launch --target {config.target}, retries: {config.retries}", file=out)
        for line in lines:
            print(mask_secrets(line, job.env), file=out)
        return 0
    if config.target == "slurm":
        return _submit_slurm(config, job)
    if config.docker_build and config.docker_image:
        accelerator = "tpu" if config.target == "tpu" else "gpu"
        for argv in build_and_push(config.docker_image, accelerator):
            logger.info("running: %s", shlex.join(argv))
            subprocess.run(argv, check=True)
    grace = 3.0 if config.target == "local" else 30.0  # time for a clean exit before SIGKILL

    def attempt(k: int) -> int:
        if config.target == "tpu":
            code = ensure_tpu_vm(config, subprocess.run)  # a preempted VM is recreated first
            if code:
                return code
        return run_group(_commands(config, job), grace=grace)

    return with_retries(attempt, config.retries)


def check_inputs(config: LaunchConfig) -> None:
    """Everything a launch needs that can be checked here, before anything starts: the hosts,
    the ssh key, and (unless ``dry_run``) the target's tool on PATH; raises ``LaunchError``."""
    if config.target == "gpu":
        gpu_hosts(config)
        check_ssh_identity(config)
    tool = _TOOLS.get(config.target)
    if tool and not config.dry_run and shutil.which(tool) is None:
        hint = " (a one-node cluster: infra/slurm/single_node.sh)" if tool == "sbatch" else ""
        raise LaunchError(f"launch.target {config.target} needs `{tool}` on PATH: not found{hint}")


def plan(config: LaunchConfig, job: Job) -> list[str]:
    """Every command a launch would run, as shell lines (first attempt)."""
    if config.target == "slurm":
        path = sbatch_path(config, job)
        script = render_sbatch(config, job)
        return [f"# {path}:", *script.rstrip("\n").splitlines(), f"sbatch {shlex.quote(str(path))}"]
    lines = []
    if config.docker_build and config.docker_image:
        accelerator = "tpu" if config.target == "tpu" else "gpu"
        lines += [shlex.join(argv) for argv in build_and_push(config.docker_image, accelerator)]
    if config.target == "tpu":
        lines += recreate_plan(config)
    for command in _commands(config, job):
        env = command.env or {}
        extra = {
            k: v
            for k, v in env.items()
            if k.startswith("LOOMAX_") or k in ("JAX_PLATFORMS", "XLA_FLAGS")
        }
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
        lines.append((prefix + " " if prefix else "") + shlex.join(command.argv))
    if config.retries:
        lines.append(f"# on failure: all of the above again, up to {config.retries} more time(s)")
    return lines


def _commands(config: LaunchConfig, job: Job) -> list[Command]:
    if config.target == "local":
        return local_commands(config, job, free_port(""))  # the coordinator binds [::]
    if config.target == "tpu":
        return [Command(tpu_command(config, job))]
    return gpu_commands(config, job)


def _submit_slurm(config: LaunchConfig, job: Job) -> int:
    path = sbatch_path(config, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_sbatch(config, job))
    logger.info("submitting %s", path)
    return subprocess.run(["sbatch", str(path)]).returncode
