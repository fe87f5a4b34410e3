"""Process setup, done once at the entry point before a ``Trainer`` exists.

``setup_process`` applies the JAX settings (compilation cache, ``trainer.jax_config``),
joins the other processes of a multi-process run (``jax.distributed``) before anything
touches the devices, and names the run the same way on every process.
"""

from __future__ import annotations

import time

import jax

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
    if config.run_id is not None:
        return config.run_id
    if _shared_run_id is None:  # every process must name the run alike: process 0's clock decides
        _shared_run_id = broadcast_str("run_id", time.strftime("%Y%m%d-%H%M%S"))
    return _shared_run_id


def local_run_id() -> str:
    """A timestamp run id for a one-process run that was given none (a multi-process run
    must share one: ``setup_process``, or ``trainer.run_id``)."""
    if jax.process_count() > 1:
        raise ValueError(
            "a multi-process Trainer needs a run id every process shares: pass "
            "run_id=setup_process(config) (loomax.train.process) or set trainer.run_id"
        )
    return time.strftime("%Y%m%d-%H%M%S")
