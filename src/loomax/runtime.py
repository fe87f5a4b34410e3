"""``MeshRuntime``: a device mesh with its axis mappings, and what sharded code needs from them.

The trainer, evaluators and hooks place arrays and trace functions through this one
object (``mesh_context``, ``jit``, ``shard_batch``, ``state_shardings``); none of them
needs the trainer itself to do so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import haliax as hax
import jax
import numpy as np
from jax.sharding import Mesh

from loomax.config import ConfigError
from loomax.mesh import (
    AxisMappings,
    MeshConfig,
    batch_sharding,
    compiling_for,
    data_parallel_size,
    device_platform,
)
from loomax.mesh_fit import replicate_indivisible
from loomax.row_blocks import RowBlock, local_rows, row_blocks
from loomax.stages import PipelineConfig, pipelining

logger = logging.getLogger(__name__)


class MeshRuntime:
    """A ``Mesh`` and the parameter and compute mappings that place named axes on it."""

    def __init__(self, mesh: Mesh, mappings: AxisMappings, pipeline: PipelineConfig | None = None):
        self.mesh = mesh
        self.mappings = mappings
        self.pipeline = pipeline
        """How batches flow through the ``stage`` axis (None: ``PipelineConfig()``'s defaults)."""
        self.platform = device_platform(mesh)
        """The platform compiled for (``tpu``, ``gpu``, ``cpu``): decided here, once, and
        handed to the model code through ``mesh_context`` (``loomax.mesh.target_platform``)."""
        self._notes: set[str] = set()

    @classmethod
    def create(
        cls,
        mesh: MeshConfig,
        mappings: AxisMappings,
        devices: Sequence[jax.Device] | None = None,
        pipeline: PipelineConfig | None = None,
    ) -> MeshRuntime:
        """The runtime of ``mesh`` over ``devices`` (default: every device of every process)."""
        return cls(mesh.build(devices), mappings, pipeline)

    @property
    def data_parallel_size(self) -> int:
        """Devices a batch is split over (replica x data x expert)."""
        return data_parallel_size(self.mesh)

    def mesh_context(self) -> contextlib.ExitStack:
        """Enter the mesh, the compute mapping, the platform compiled for and the pipeline
        settings (what tracing a sharded function needs)."""
        stack = contextlib.ExitStack()
        stack.enter_context(pipelining(self.pipeline))
        stack.enter_context(hax.partitioning.set_mesh(self.mesh))
        stack.enter_context(compiling_for(self.platform))
        stack.enter_context(hax.axis_mapping(self.mappings.compute))
        return stack

    def state_shardings(self, tree: Any, mapping: dict | None = None) -> Any:
        """Shardings of a state (or its shapes) under ``mapping`` (default: the parameter
        mapping); an axis whose size does not divide over its mesh axes is kept whole (with a
        warning, once)."""
        shardings = hax.partitioning.infer_resource_partitions(
            tree,
            self.mappings.parameter if mapping is None else mapping,
            preserve_existing_shardings=False,
            mesh=self.mesh,
        )
        shardings, notes = replicate_indivisible(shardings, tree)
        for note in notes:
            if note not in self._notes:
                self._notes.add(note)
                logger.warning("parameter mapping: %s: kept whole on every device", note)
        return shardings

    @functools.cached_property
    def row_block(self) -> RowBlock:
        """The rows of every batch this process loads: block ``index`` of ``count`` equal
        blocks (``row_blocks``; the processes of a context group spanning hosts share one).
        ``BatchLoader.batch(step, *runtime.row_block)`` reads them."""
        blocks = row_blocks(self.mesh.devices)
        process = jax.process_index()
        if process not in blocks:
            raise ConfigError(f"trainer.mesh: process {process} holds no device of the mesh")
        return blocks[process]

    def shard_batch(self, local_batch: Any) -> Any:
        """A global batch array from this process's rows (its ``row_block``), split over
        (replica, data, expert): each device gets the rows of its batch position."""
        block = self.row_block

        def to_global(x):
            x = np.asarray(x)
            sharding = batch_sharding(self.mesh, x.ndim)
            shape = (x.shape[0] * block.count, *x.shape[1:])
            rows = functools.partial(local_rows, block=block, local=x.shape[0], total=shape[0])
            return jax.make_array_from_callback(shape, sharding, lambda index: x[rows(index)])

        return jax.tree.map(to_global, local_batch)

    def jit(self, fn: Callable, **jit_kwargs) -> Callable:
        """``jax.jit(fn)``, traced and run inside ``mesh_context``; ``.jitted`` is the raw jit."""
        jitted = jax.jit(fn, **jit_kwargs)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with self.mesh_context():
                return jitted(*args, **kwargs)

        call.jitted = jitted  # for .lower() and cache inspection
        return call
