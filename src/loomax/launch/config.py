"""``LaunchConfig``: where and how ``loomax launch`` starts a command (``.loomax.yaml`` + flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loomax.errors import UserError

TARGETS = ("local", "tpu", "gpu", "slurm")

DEFAULT_FORWARD_ENV = [
    "WANDB_API_KEY",
    "WANDB_ENTITY",
    "WANDB_PROJECT",
    "WANDB_MODE",
    "HF_TOKEN",
    "JAX_COMPILATION_CACHE_DIR",
    "TPU_STDERR_LOG_LEVEL",
    "LIBTPU_INIT_ARGS",
    "RAY_ADDRESS",
]


class LaunchError(UserError, ValueError):
    """A bad launch option or a missing tool; the message names the option (one line in the CLI)."""


@dataclass(frozen=True)
class LaunchConfig:
    """Options of ``loomax launch``; defaults come from ``.loomax.yaml``, flags override them."""

    target: str = "local"
    """Where to run: local (N processes here), tpu (a TPU VM pod), gpu (hosts over SSH) or slurm."""
    dry_run: bool = False
    """Print every command instead of running it."""
    retries: int = 0
    """Relaunch this many times after a failure or preemption; a train run resumes from its latest checkpoint."""
    run_id: str | None = None
    """trainer.run_id added to a train command that names no run, so every retry resumes the same run; null = a timestamp."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for every process."""
    forward_env: list[str] = field(default_factory=lambda: list(DEFAULT_FORWARD_ENV))
    """Variables passed through from the launching shell when set there (WANDB_API_KEY, JAX_COMPILATION_CACHE_DIR, ...)."""

    # local
    num_processes: int = 2
    """local: processes started on this machine (each one JAX process on CPU devices)."""
    devices_per_process: int = 1
    """local: CPU devices per process (--xla_force_host_platform_device_count)."""

    # TPU VM pods
    tpu_name: str | None = None
    """tpu: name of the TPU VM (pod slice)."""
    zone: str | None = None
    """tpu: its zone, e.g. us-central2-b."""
    project: str | None = None
    """tpu: its Google Cloud project; null = gcloud's default."""
    accelerator_type: str | None = None
    """tpu: e.g. v4-32; with runtime_version, the VM is created when missing and recreated when preempted, before each attempt."""
    runtime_version: str | None = None
    """tpu: the VM's software version for creating it, e.g. tpu-ubuntu2204-base."""
    spot: bool = False
    """tpu: create the VM as a Spot VM (gcloud --spot)."""
    setup_command: str | None = None
    """tpu: shell command every worker runs after the VM is (re)created (e.g. clone the repo, make its .venv); null = none."""

    # GPU hosts
    hosts: list[str] | None = None
    """gpu: the hosts, [user@]host[:port] each; the first is the coordinator (or use hostfile)."""
    hostfile: str | None = None
    """gpu: file with one host per line ([user@]host[:port]); the first is the coordinator."""
    processes_per_host: int = 1
    """gpu, slurm: processes per host; 1 = one using all GPUs, N = one per GPU (CUDA_VISIBLE_DEVICES)."""
    coordinator_port: int = 8476
    """gpu: port of the jax.distributed coordinator on the first host."""
    ssh_options: list[str] = field(
        default_factory=lambda: ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
    )
    """gpu: options given to ssh."""
    ssh_port: int | None = None
    """gpu: ssh port of every host that names none (host:port); null = ssh's default (22 or ~/.ssh/config)."""
    ssh_identity: str | None = None
    """gpu: private key file for ssh -i; null = ssh's default keys or agent."""

    # remote code
    remote_dir: str = "~/loomax"
    """tpu, gpu, slurm: the repository on every host (with its .venv), when not using docker."""
    loomax_bin: str = ".venv/bin/loomax"
    """tpu, gpu, slurm: the loomax executable, relative to remote_dir."""
    docker_image: str | None = None
    """tpu, gpu: run the command in this image on every host (e.g. us-docker.pkg.dev/P/loomax/loomax:latest)."""
    docker_build: bool = False
    """tpu, gpu: build docker_image from infra/docker/Dockerfile and push it before launching."""

    # SLURM
    nodes: int = 1
    """slurm: nodes of the job."""
    gpus_per_node: int = 8
    """slurm: GPUs per node; 0 = request none (a CPU cluster)."""
    partition: str | None = None
    """slurm: partition; null = the cluster's default."""
    time_limit: str = "24:00:00"
    """slurm: wall-time limit of the job."""
    job_name: str = "loomax"
    """slurm: job name."""
    sbatch_template: str = "infra/slurm/loomax.sbatch"
    """slurm: the sbatch script template to fill in."""

    def __post_init__(self):
        if self.target not in TARGETS:
            raise LaunchError(
                f"launch.target must be one of {', '.join(TARGETS)}, got {self.target!r}"
            )
        positive = (
            "num_processes",
            "devices_per_process",
            "processes_per_host",
            "coordinator_port",
            "nodes",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise LaunchError(f"launch.{name} must be > 0, got {getattr(self, name)}")
        if self.gpus_per_node < 0:
            raise LaunchError(f"launch.gpus_per_node must be >= 0, got {self.gpus_per_node}")
        if self.ssh_port is not None and not 0 < self.ssh_port < 65536:
            raise LaunchError(f"launch.ssh_port must be in 1..65535, got {self.ssh_port}")
        if bool(self.accelerator_type) != bool(self.runtime_version):
            raise LaunchError(
                "launch.accelerator_type and launch.runtime_version go together (to create the TPU VM)"
            )
        if self.retries < 0:
            raise LaunchError(f"launch.retries must be >= 0, got {self.retries}")
        if self.target == "tpu" and not (self.tpu_name and self.zone):
            raise LaunchError(
                "launch --target tpu needs --tpu_name and --zone (flags or .loomax.yaml)"
            )
        if self.target == "gpu" and not (self.hosts or self.hostfile):
            raise LaunchError(
                "launch --target gpu needs launch.hosts or launch.hostfile (--hosts '[h1, h2]', --hostfile FILE or .loomax.yaml)"
            )
        if self.hosts and self.hostfile:
            raise LaunchError("launch.hosts and launch.hostfile both name the hosts: give one")
        if self.docker_build and not self.docker_image:
            raise LaunchError("launch.docker_build needs launch.docker_image (the tag to build)")
