"""Process setup, done once at the entry point before a ``Trainer`` exists.

``setup_process`` applies the JAX settings (compilation cache, ``trainer.jax_config``),
joins the other processes of a multi-process run (``jax.distributed``) before anything
touches the devices, names the run the same way on every process and, with
``trainer.log_dir``, writes each process's Python log to a file of its own.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax

from loomax.config import ConfigError
from loomax.distributed import broadcast_str
from loomax.jax_setup import apply_jax_settings
from loomax.train.config import TrainerConfig

_shared_run_id: str | None = None


def setup_process(config: TrainerConfig) -> str:
    """Prepare this process for the run of ``config``; returns the run id every process shares.

    Call it before building the ``Trainer`` (and pass it the returned ``run_id``) whenever
    the run may span several processes. Safe to call more than once.
    """
    global _shared_run_id
    apply_jax_settings(config.jax_compilation_cache_dir, config.jax_config)
    config.distributed.initialize()  # before anything touches the devices
    check_accelerator(config)
    run_id = config.run_id
    if run_id is None:
        # every process must name the run alike: process 0's clock decides
        if _shared_run_id is None:
            _shared_run_id = broadcast_str("run_id", time.strftime("%Y%m%d-%H%M%S"))
        run_id = _shared_run_id
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


def local_run_id() -> str:
    """A timestamp run id for a one-process run that was given none (a multi-process run
    must share one: ``setup_process``, or ``trainer.run_id``)."""
    if jax.process_count() > 1:
        raise ValueError(
            "a multi-process Trainer needs a run id every process shares: pass "
            "run_id=setup_process(config) (loomax.train.process) or set trainer.run_id"
        )
    return time.strftime("%Y%m%d-%H%M%S")
