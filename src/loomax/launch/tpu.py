"""``--target tpu``: the command on every worker of a TPU VM pod, via ``gcloud ... ssh --worker=all``.

JAX finds the pod's other workers by itself (``jax.distributed`` auto-detection). With
``accelerator_type`` and ``runtime_version`` set, each attempt first makes sure the VM
exists: a missing one is created, a preempted (or terminated) one is deleted and created
again with the same settings, and ``setup_command`` runs on its fresh workers.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
from collections.abc import Callable

from loomax.launch.config import LaunchConfig
from loomax.launch.docker import docker_run
from loomax.launch.job import Job, shell_command

logger = logging.getLogger(__name__)

PIDFILE = "/tmp/loomax-launch.pid"
"""Where each worker records the launched process, so a retry can stop what is left of it."""

LIVE_STATES = ("READY", "CREATING", "STARTING", "RESTARTING", "REPAIRING")
"""TPU VM states that a retry keeps; any other (PREEMPTED, TERMINATED, ...) is recreated."""


def tpu_vm(config: LaunchConfig, verb: str) -> list[str]:
    """``gcloud compute tpus tpu-vm VERB NAME --zone Z [--project P]``."""
    argv = ["gcloud", "compute", "tpus", "tpu-vm", verb, str(config.tpu_name)]
    argv += ["--zone", str(config.zone)]
    if config.project:
        argv += ["--project", config.project]
    return argv


def tpu_ssh(config: LaunchConfig, remote_command: str) -> list[str]:
    """``gcloud compute tpus tpu-vm ssh NAME --zone Z [--project P] --worker=all --command CMD``."""
    return [*tpu_vm(config, "ssh"), "--worker=all", "--command", remote_command]


def tpu_command(config: LaunchConfig, job: Job) -> list[str]:
    """The ssh command that starts ``job`` on every worker (in docker_image if set)."""
    if config.docker_image:
        remote = docker_run(config.docker_image, job.args, job.env, "tpu")
    else:
        remote = shell_command(
            [config.loomax_bin, *job.args], job.env, cwd=config.remote_dir, pidfile=PIDFILE
        )
    return tpu_ssh(config, remote)


def describe_command(config: LaunchConfig) -> list[str]:
    """Prints the VM's state (READY, PREEMPTED, ...); fails when there is no such VM."""
    return [*tpu_vm(config, "describe"), "--format=value(state)"]


def create_commands(config: LaunchConfig, delete_first: bool) -> list[list[str]]:
    """Delete (a preempted VM), create with the configured settings, then run ``setup_command``."""
    create = [*tpu_vm(config, "create"), "--accelerator-type", str(config.accelerator_type)]
    create += ["--version", str(config.runtime_version)]
    if config.spot:
        create.append("--spot")
    commands = [[*tpu_vm(config, "delete"), "--quiet"]] if delete_first else []
    commands.append(create)
    if config.setup_command:
        commands.append(tpu_ssh(config, config.setup_command))
    return commands


def recreate_plan(config: LaunchConfig) -> list[str]:
    """The shell lines ``--dry-run`` shows for the check-and-recreate step before each attempt."""
    if not config.accelerator_type:
        return []
    lines = [
        "# before each attempt: the VM's state; when missing it is created, when not "
        f"{'/'.join(LIVE_STATES)} (e.g. PREEMPTED) it is deleted and created again:",
        shlex.join(describe_command(config)),
    ]
    return lines + [shlex.join(argv) for argv in create_commands(config, delete_first=True)]


def ensure_tpu_vm(config: LaunchConfig, run: Callable[..., subprocess.CompletedProcess]) -> int:
    """Create or recreate the VM as needed (``run`` is ``subprocess.run``); 0 on success."""
    if not config.accelerator_type:
        return 0
    described = run(describe_command(config), capture_output=True, text=True)
    state = described.stdout.strip() if described.returncode == 0 else None
    if state in LIVE_STATES:
        return 0
    logger.warning(
        "TPU VM %s is %s: %s it",
        config.tpu_name,
        state or "missing",
        "creating" if state is None else "recreating",
    )
    for argv in create_commands(config, delete_first=state is not None):
        logger.info("running: %s", shlex.join(argv))
        code = run(argv).returncode
        if code:
            logger.error("failed (exit %d): %s", code, shlex.join(argv))
            return code
    return 0
