"""Docker pieces of a pod launch: build and push the image, run the command in it on a host."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

DOCKERFILE = "infra/docker/Dockerfile"
CONTAINER = "loomax"


def build_and_push(image: str, accelerator: str) -> list[list[str]]:
    """``docker build`` (GPU or TPU variant by build arg) and ``docker push`` of ``image``."""
    return [
        [
            "docker",
            "build",
            "-t",
            image,
            "-f",
            DOCKERFILE,
            "--build-arg",
            f"ACCELERATOR={accelerator}",
            ".",
        ],
        ["docker", "push", image],
    ]


def docker_run(
    image: str,
    args: Sequence[str],
    env: Mapping[str, str],
    accelerator: str,
    gpus: str | None = None,
    name: str = CONTAINER,
) -> str:
    """The shell command a host runs: remove a container left by an earlier attempt, then run."""
    flags = ["--rm", "--name", name, "--net=host", "--ipc=host", "--shm-size=16g"]
    if accelerator == "tpu":
        flags.append("--privileged")  # the TPU devices (/dev/accel*, /dev/vfio)
    else:
        flags += ["--gpus", gpus or "all"]
    flags += ["-v", "/tmp:/tmp"]
    for key, value in env.items():
        flags += ["-e", f"{key}={value}"]
    run = ["docker", "run", *flags, image, "loomax", *args]
    cleanup = f"docker rm -f {name} >/dev/null 2>&1;"
    return f"{cleanup} {' '.join(shlex.quote(a) for a in run)}"
