"""``--target gpu``: one process per host (or per GPU) over SSH; the first host coordinates."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loomax.distributed import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV
from loomax.launch.config import LaunchConfig, LaunchError
from loomax.launch.docker import docker_run
from loomax.launch.job import Job, shell_command
from loomax.launch.processes import Command


@dataclass(frozen=True)
class Host:
    """One SSH destination: ``login`` (``[user@]host``) and its port (None: the default)."""

    login: str
    port: int | None = None

    @property
    def address(self) -> str:
        """The host name or IP, without the user."""
        return self.login.rsplit("@", 1)[-1]


def parse_host(entry: str, key: str = "launch.hosts") -> Host:
    """``[user@]host[:port]`` -> ``Host``; a bad port raises ``LaunchError`` naming ``key``."""
    login, colon, port = entry.strip().rpartition(":")
    if not colon or "]" in port or login.count(":"):  # no port (or a bare IPv6 address)
        return Host(entry.strip())
    if not port.isdigit() or not 0 < int(port) < 65536 or not login:
        raise LaunchError(
            f"{key}: bad host {entry!r}: expected [user@]host[:port] with a port in 1..65535"
        )
    return Host(login, int(port))


def read_hostfile(path: str) -> list[str]:
    """Hosts (``[user@]host[:port]``), one per line; blank lines and ``#`` comments are skipped."""
    file = Path(path)
    if not file.is_file():
        raise LaunchError(f"launch.hostfile: no such file: {path}")
    hosts = [line.split("#", 1)[0].strip() for line in file.read_text().splitlines()]
    hosts = [h for h in hosts if h]
    if not hosts:
        raise LaunchError(f"launch.hostfile {path} lists no hosts")
    return hosts


def gpu_hosts(config: LaunchConfig) -> list[Host]:
    """The hosts of ``config.hosts`` or ``config.hostfile``, checked."""
    if config.hosts:
        entries, key = [h for h in config.hosts if h.strip()], "launch.hosts"
    else:
        entries, key = read_hostfile(str(config.hostfile)), "launch.hostfile"
    if not entries:
        raise LaunchError("launch.hosts lists no hosts")
    return [parse_host(entry, key) for entry in entries]


def check_ssh_identity(config: LaunchConfig) -> None:
    """``launch.ssh_identity``, when set, must be a readable file."""
    if config.ssh_identity and not Path(config.ssh_identity).expanduser().is_file():
        raise LaunchError(f"launch.ssh_identity: no such key file: {config.ssh_identity}")


def ssh_argv(config: LaunchConfig, host: Host, remote: str) -> list[str]:
    """``ssh [-p PORT] [-i KEY] OPTIONS [user@]host REMOTE``."""
    argv = ["ssh"]
    port = host.port or config.ssh_port
    if port:
        argv += ["-p", str(port)]
    if config.ssh_identity:
        argv += ["-i", config.ssh_identity]
    return [*argv, *config.ssh_options, host.login, remote]


def gpu_commands(config: LaunchConfig, job: Job) -> list[Command]:
    """An ``ssh HOST 'cd DIR && env ... loomax ...'`` per process, with its process id."""
    hosts = gpu_hosts(config)
    check_ssh_identity(config)
    coordinator = f"{hosts[0].address}:{config.coordinator_port}"
    per_host = config.processes_per_host
    total = len(hosts) * per_host
    commands = []
    for h, host in enumerate(hosts):
        for local in range(per_host):
            process_id = h * per_host + local
            env = {
                **job.env,
                COORDINATOR_ENV: coordinator,
                NUM_PROCESSES_ENV: str(total),
                PROCESS_ID_ENV: str(process_id),
            }
            gpus = None
            if per_host > 1:
                env["CUDA_VISIBLE_DEVICES"] = str(local)
                gpus = f"device={local}"
            if config.docker_image:
                name = f"loomax-{local}" if per_host > 1 else "loomax"
                remote = docker_run(config.docker_image, job.args, env, "gpu", gpus=gpus, name=name)
            else:
                # one pidfile per process id: a host listed twice runs two processes
                pidfile = f"/tmp/loomax-launch-{process_id}.pid"
                remote = shell_command(
                    [config.loomax_bin, *job.args], env, cwd=config.remote_dir, pidfile=pidfile
                )
            commands.append(Command(ssh_argv(config, host, remote)))
    return commands
