"""``--target tpu``: the command on every worker of a TPU VM pod, via ``gcloud ... ssh --worker=all``.

JAX finds the pod's other workers by itself (``jax.distributed`` auto-detection).
"""

from __future__ import annotations

from loomax.launch.config import LaunchConfig
from loomax.launch.docker import docker_run
from loomax.launch.job import Job, shell_command

PIDFILE = "/tmp/loomax-launch.pid"
"""Where each worker records the launched process, so a retry can stop what is left of it."""


def tpu_ssh(config: LaunchConfig, remote_command: str) -> list[str]:
    """``gcloud compute tpus tpu-vm ssh NAME --zone Z [--project P] --worker=all --command CMD``."""
    argv = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", str(config.tpu_name)]
    argv += ["--zone", str(config.zone)]
    if config.project:
        argv += ["--project", config.project]
    return [*argv, "--worker=all", "--command", remote_command]


def tpu_command(config: LaunchConfig, job: Job) -> list[str]:
    """The ssh command that starts ``job`` on every worker (in docker_image if set)."""
    if config.docker_image:
        remote = docker_run(config.docker_image, job.args, job.env, "tpu")
    else:
        remote = shell_command(
            [config.loomax_bin, *job.args], job.env, cwd=config.remote_dir, pidfile=PIDFILE
        )
    return tpu_ssh(config, remote)
