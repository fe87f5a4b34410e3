"""JAX settings: the platforms JAX may start, and what a run applies when it starts.

``choose_platforms`` (applied when ``loomax`` is imported) keeps JAX from starting an
accelerator backend whose hardware this host lacks: TPU where libtpu is installed but no TPU
chip is attached (libtpu would print its probes and JAX "Unable to initialize backend
'tpu'"), CUDA where JAX's CUDA plugin is installed but no NVIDIA GPU is (the plugin would
print "Unable to load CUDA" and its traceback). Compiling for TPU or GPU topologies needs
neither backend: ``jax.experimental.topologies`` makes compile-only devices directly. ``trainer.jax_compilation_cache_dir``
(or ``JAX_COMPILATION_CACHE_DIR``) keeps compiled steps across restarts, so a job
relaunched after a preemption skips its compile; ``trainer.jax_config`` sets arbitrary
``jax.config`` options by name.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import pkgutil
import sys
from collections.abc import Mapping
from typing import Any

TPU_DEVICE_FILES = ("/dev/accel0", "/dev/vfio/0")
"""Where a TPU VM shows its chips (v2-v4 and v5e: accel; v5p and v6e: vfio)."""

logger = logging.getLogger(__name__)


def check_jax_options(options: Mapping[str, Any], where: str = "trainer.jax_config") -> None:
    """Raise ``ValueError`` naming ``where`` and the option if any name is not a JAX option."""
    import jax

    known = jax.config.values
    unknown = sorted(name for name in options if name not in known)
    if unknown:
        close = [k for k in known if any(u.removeprefix("jax_") in k for u in unknown)][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ValueError(f"{where}: unknown JAX option(s) {', '.join(unknown)}{hint}")


def apply_jax_settings(cache_dir: str | None, options: Mapping[str, Any]) -> None:
    """Point JAX's persistent compilation cache at ``cache_dir`` (if given), then set ``options``."""
    import jax

    check_jax_options(options)
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        logger.info("JAX compilation cache: %s", cache_dir)
    for name, value in options.items():
        jax.config.update(name, value)


def has_tpu_chips() -> bool:
    """Whether this host has TPU chips attached."""
    return any(os.path.exists(p) for p in TPU_DEVICE_FILES)


def has_gpus(platform: str = "cuda") -> bool:
    """Whether this host shows GPUs of ``platform`` (``cuda``: NVIDIA's device files, or
    WSL's ``/dev/dxg``; ``rocm``: ``/dev/kfd``)."""
    return any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES.get(platform, ()))


GPU_DEVICE_FILES = {"cuda": ("/dev/nvidia[0-9]*", "/dev/dxg"), "rocm": ("/dev/kfd",)}
"""Where a host shows its GPUs to processes (globs)."""


def choose_platforms() -> str | None:
    """Start JAX on the platforms whose hardware is present: leave TPU out without TPU
    chips, and a GPU plugin's platform out without that GPU; keep CPU.

    Applies where the platforms are not chosen already (``JAX_PLATFORMS``) and an
    accelerator JAX would try (libtpu, a CUDA or ROCm plugin) is installed without its
    hardware; returns the platforms set, or None. Compiling for a TPU or GPU topology
    (``loomax compile``) needs no such backend: libtpu and the CUDA plugin serve it directly.
    """
    if os.environ.get("JAX_PLATFORMS") or has_tpu_chips():
        return None
    installed = _gpu_platforms()
    present = [p for p in installed if has_gpus(p)]
    if importlib.util.find_spec("libtpu") is None and present == installed:
        return None  # every installed accelerator has its hardware: JAX's own choice
    platforms = ",".join([*present, "cpu"])
    jax = sys.modules.get("jax")
    if jax is None:
        os.environ["JAX_PLATFORMS"] = platforms  # read when JAX is imported; JAX stays unloaded
    elif jax.config.jax_platforms:
        return None
    else:
        jax.config.update("jax_platforms", platforms)
    return platforms


def _gpu_platforms() -> list[str]:
    """The GPU platforms of the installed PJRT plugins (``jax_plugins.xla_cuda12`` etc.)."""
    try:
        import jax_plugins
    except ImportError:
        return []
    names = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    return [p for p in ("cuda", "rocm") if any(p in n for n in names)]


def process_index_before_backend() -> int:
    """This process's index, read without starting JAX's backend where none runs yet.

    ``jax.distributed``'s process id, else JAX's own answer once its backend runs, else 0.
    The checks a run makes before its data build ask this: the backend starts threads, and
    Ray, started for the data, forks its daemons, which beside those threads may deadlock
    (JAX warns so). A multi-host run without ``jax.distributed`` (libtpu's own) reads 0 on
    every host until its backend starts: use it only where any process may act.
    """
    # private: no public API gives the process id before the backend starts, or whether it has
    from jax._src import distributed, xla_bridge

    if distributed.global_state.client is not None:
        return distributed.global_state.process_id
    if xla_bridge.backends_are_initialized():
        import jax

        return jax.process_index()
    return 0
