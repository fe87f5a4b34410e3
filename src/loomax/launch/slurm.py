"""``--target slurm``: an sbatch script from ``infra/slurm/loomax.sbatch``, submitted with ``sbatch``.

Inside the job, JAX's auto-detection reads SLURM's variables; the script retries itself.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from loomax.launch.config import LaunchConfig, LaunchError
from loomax.launch.job import Job, quote_path


def render_sbatch(config: LaunchConfig, job: Job) -> str:
    """The sbatch script of ``job``: the template with every ``@@FIELD@@`` filled in."""
    template = Path(config.sbatch_template)
    if not template.is_file() and not template.is_absolute():
        template = Path(__file__).resolve().parents[3] / template  # the source checkout's infra/
    if not template.is_file():
        raise LaunchError(f"launch.sbatch_template: no such file: {config.sbatch_template}")
    if config.docker_image:
        raise LaunchError(
            "launch.docker_image is not supported with --target slurm (it runs from remote_dir)"
        )
    fields = {
        "JOB_NAME": config.job_name,
        "NODES": str(config.nodes),
        "TASKS_PER_NODE": str(config.processes_per_host),
        "GPUS_PER_NODE": str(config.gpus_per_node),
        "GPUS": f"#SBATCH --gpus-per-node={config.gpus_per_node}" if config.gpus_per_node else "",
        "TIME_LIMIT": config.time_limit,
        "PARTITION": f"#SBATCH --partition={config.partition}" if config.partition else "",
        "REMOTE_DIR": quote_path(config.remote_dir),
        "EXPORTS": "\n".join(f"export {k}={shlex.quote(v)}" for k, v in job.env.items()),
        "RETRIES": str(config.retries),
        "COMMAND": " ".join(shlex.quote(a) for a in [config.loomax_bin, *job.args]),
    }
    text = template.read_text()
    for name, value in fields.items():
        text = text.replace(f"@@{name}@@", value)
    unknown = sorted(set(re.findall(r"@@(\w+)@@", text)))
    if unknown:
        raise LaunchError(
            f"launch.sbatch_template {template} has fields loomax does not fill: {', '.join(unknown)}"
        )
    return text


def sbatch_path(config: LaunchConfig, job: Job) -> Path:
    """Where the filled-in script is written before ``sbatch`` submits it."""
    run_id = (
        job.args[job.args.index("--trainer.run_id") + 1]
        if "--trainer.run_id" in job.args
        else "job"
    )
    return Path(".loomax") / "slurm" / f"{config.job_name}-{run_id}.sbatch"
