"""``loomax launch``: start a loomax command on a TPU pod, GPU hosts, SLURM or N local processes."""

from loomax.launch.config import TARGETS, LaunchConfig, LaunchError
from loomax.launch.launcher import defaults_file, launch, plan, split_launch_args

__all__ = [
    "TARGETS",
    "LaunchConfig",
    "LaunchError",
    "defaults_file",
    "launch",
    "plan",
    "split_launch_args",
]
