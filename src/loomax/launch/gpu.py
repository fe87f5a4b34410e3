"""``--target gpu``: one process per host (or per GPU) over SSH; the first host coordinates."""

from __future__ import annotations

from pathlib import Path

from loomax.distributed import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV
from loomax.launch.config import LaunchConfig
from loomax.launch.docker import docker_run
from loomax.launch.job import Job, shell_command
from loomax.launch.processes import Command


def read_hostfile(path: str) -> list[str]:
    """Hosts (``[user@]host``), one per line; blank lines and ``#`` comments are skipped."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"launch.hostfile: no such file: {path}")
    hosts = [line.split("#", 1)[0].strip() for line in file.read_text().splitlines()]
    hosts = [h for h in hosts if h]
    if not hosts:
        raise ValueError(f"launch.hostfile {path} lists no hosts")
    return hosts


def gpu_commands(config: LaunchConfig, job: Job) -> list[Command]:
    """An ``ssh HOST 'cd DIR && env ... loomax ...'`` per process, with its process id."""
    hosts = read_hostfile(str(config.hostfile))
    coordinator = f"{hosts[0].rsplit('@', 1)[-1]}:{config.coordinator_port}"
    per_host = config.processes_per_host
    total = len(hosts) * per_host
    commands = []
    for h, host in enumerate(hosts):
        for local in range(per_host):
            env = {
                **job.env,
                COORDINATOR_ENV: coordinator,
                NUM_PROCESSES_ENV: str(total),
                PROCESS_ID_ENV: str(h * per_host + local),
            }
            gpus = None
            if per_host > 1:
                env["CUDA_VISIBLE_DEVICES"] = str(local)
                gpus = f"device={local}"
            if config.docker_image:
                name = f"loomax-{local}" if per_host > 1 else "loomax"
                remote = docker_run(config.docker_image, job.args, env, "gpu", gpus=gpus, name=name)
            else:
                pidfile = f"/tmp/loomax-launch-{local}.pid"
                remote = shell_command(
                    [config.loomax_bin, *job.args], env, cwd=config.remote_dir, pidfile=pidfile
                )
            commands.append(Command(["ssh", *config.ssh_options, host, remote]))
    return commands
