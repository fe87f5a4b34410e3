"""Process setup, done once at the entry point before a ``Trainer`` exists.

``setup_process`` applies the JAX settings (compilation cache, ``trainer.jax_config``),
joins the other processes of a multi-process run (``jax.distributed``) before anything
touches the devices, names the run the same way on every process and, with
``trainer.log_dir``, writes each process's Python log to a file of its own.

A run with no ``trainer.run_id`` is named by its run directory when that records one
(``<run_dir>/run_id``, written by the ``Trainer`` once the run's state is made), so the
same command started again continues the same run; else by process 0's clock.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax

from loomax.atomic_files import replace_text
from loomax.config import ConfigError
from loomax.distributed import broadcast_str
from loomax.jax_setup import apply_jax_settings
from loomax.train.config import TrainerConfig

RUN_ID_FILE = "run_id"
"""``<run_dir>/run_id``: the id of the run that last trained in that run directory."""

_shared_run_ids: dict[str | None, str] = {}
"""The run id agreed in this process, by ``trainer.run_dir`` (each agreed once)."""


def setup_process(config: TrainerConfig) -> str:
    """Prepare this process for the run of ``config``; returns the run id every process shares.

    Call it before building the ``Trainer`` (and pass it the returned ``run_id``) whenever
    the run may span several processes. Safe to call more than once.
    """
    apply_jax_settings(config.jax_compilation_cache_dir, config.jax_config)
    config.distributed.initialize()  # before anything touches the devices
    check_accelerator(config)
    run_id = config.run_id
    if run_id is None:
        # every process must name the run alike: process 0's run dir, else its clock, decides
        if config.run_dir not in _shared_run_ids:
            proposal = recorded_run_id(config.run_dir) or time.strftime("%Y%m%d-%H%M%S")
            key = f"run_id/{config.run_dir}"
            _shared_run_ids[config.run_dir] = broadcast_str(key, proposal)
        run_id = _shared_run_ids[config.run_dir]
    if config.log_dir is not None:
        log_to_file(Path(config.log_dir) / f"{run_id}.process-{jax.process_index()}.log")
    return run_id


def check_accelerator(config: TrainerConfig) -> None:
    """With ``trainer.require_accelerator``, fail when JAX sees only CPUs."""
    if not config.require_accelerator:
        return
    platforms = sorted({d.platform for d in jax.devices()})
    if platforms == ["cpu"]:
        raise ConfigError(
            "trainer.require_accelerator is set but JAX found no GPU or TPU on this host "
            f"(only {len(jax.devices())} CPU device(s))"
        )


def device_line(config: TrainerConfig) -> str:
    """One line saying where a run runs: its devices and processes, and the mesh over them
    (``trainer.mesh``); raises ``ConfigError`` when the mesh does not fit the devices."""
    devices = jax.devices()
    platform = devices[0].platform
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    kinds = kinds if kinds.lower() == platform else f"{kinds} ({platform})"
    processes = jax.process_count()
    where = f"devices: {len(devices)} x {kinds} in {processes} process" + "es" * (processes > 1)
    if config.mesh.auto:
        return f"{where}; mesh chosen for them at start (trainer.mesh.auto)"
    sizes = config.mesh.resolve(len(devices))
    return f"{where}; mesh {' '.join(f'{a}={n}' for a, n in sizes.items())} (trainer.mesh)"


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_file(path: Path) -> logging.Handler:
    """Append this process's log records (INFO and up) to ``path`` as well; once per path."""
    root = logging.getLogger()
    for handler in root.handlers:
        same = Path(getattr(handler, "baseFilename", "")) == path.absolute()
        if isinstance(handler, logging.FileHandler) and same:
            return handler
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:  # a library use without logging set up
        root.setLevel(logging.INFO)
    return handler


def local_run_id(run_dir: str | Path | None = None) -> str:
    """The id of a one-process run that was given none: the one ``run_dir`` records, else a
    timestamp (a multi-process run must share one: ``setup_process``, or ``trainer.run_id``)."""
    if jax.process_count() > 1:
        raise ValueError(
            "a multi-process Trainer needs a run id every process shares: pass "
            "run_id=setup_process(config) (loomax.train.process) or set trainer.run_id"
        )
    return recorded_run_id(run_dir) or time.strftime("%Y%m%d-%H%M%S")


def recorded_run_id(run_dir: str | Path | None) -> str | None:
    """The run id ``run_dir`` records (``RUN_ID_FILE``), or None (no run dir, no record)."""
    if run_dir is None:
        return None
    path = Path(run_dir) / RUN_ID_FILE
    if not path.is_file():
        return None
    return path.read_text(encoding="utf-8").strip() or None


def record_run_id(run_dir: str | Path, run_id: str) -> None:
    """Record in ``run_dir`` that run ``run_id`` trains there (replacing an older record)."""
    if recorded_run_id(run_dir) != run_id:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        replace_text(Path(run_dir) / RUN_ID_FILE, run_id + "\n")
