"""Which rows of a global batch each process loads, from the mesh's device grid.

A batch's leading axis is split over the data-parallel mesh axes (replica, data, expert):
``dp`` *batch positions*, each a ``1 / dp`` share of the rows. A device holds the rows of
its batch position (whole: the sequence is split over ``context`` only inside the step).
A process must load the rows of every batch position its devices hold. When those
positions form one contiguous block per process and two processes' blocks are either
the same or disjoint, the distinct blocks split the batch evenly: a process loads block
``index`` of ``count`` (the processes of one ``context`` or ``model`` group spanning
hosts load the same block). Any other layout is refused with a ``ConfigError``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from loomax.config import ConfigError

DATA_AXES_COUNT = 3
"""The leading axes of a (replica, data, expert, context, model, stage) grid that split the batch."""


class RowBlock(NamedTuple):
    """This process loads row block ``index`` of ``count`` equal blocks of every batch."""

    index: int
    count: int


def batch_positions(grid: np.ndarray) -> dict[int, list[int]]:
    """For each process, the sorted batch positions its devices hold in ``grid``."""
    lead = grid.shape[:DATA_AXES_COUNT]
    held: dict[int, set[int]] = {}
    for where, device in np.ndenumerate(grid):
        position = int(np.ravel_multi_index(where[:DATA_AXES_COUNT], lead))
        held.setdefault(int(device.process_index), set()).add(position)
    return {process: sorted(positions) for process, positions in sorted(held.items())}


def row_blocks(grid: np.ndarray) -> dict[int, RowBlock]:
    """Each process's row block of a (replica, data, expert, context, model, stage) device ``grid``.

    Raises ``ConfigError`` (naming ``trainer.mesh``) when a process's batch positions are
    not contiguous, or two processes' blocks overlap without being equal, or the blocks
    differ in size: no split of the rows into equal blocks then gives every process the
    rows of its devices.
    """
    held = batch_positions(grid)
    blocks = sorted({(p[0], p[-1] + 1) for p in held.values()})
    where = f"trainer.mesh (replica, data, expert, context, model, stage: {tuple(grid.shape)})"
    for process, positions in held.items():
        if positions != list(range(positions[0], positions[-1] + 1)):
            raise ConfigError(
                f"{where}: process {process}'s devices hold batch positions {positions}, not one "
                "contiguous block; choose mesh sizes whose data-parallel groups align with hosts"
            )
    for (start, stop), (next_start, _) in zip(blocks, blocks[1:], strict=False):
        if next_start < stop:
            raise ConfigError(
                f"{where}: processes hold overlapping batch blocks [{start}, {stop}) and "
                f"[{next_start}, ...); each process's devices must hold the same rows as, or "
                "none of, another's (align trainer.mesh.context and model with hosts)"
            )
    sizes = {stop - start for start, stop in blocks}
    if len(sizes) > 1:
        raise ConfigError(
            f"{where}: processes hold batch blocks of unequal sizes {sorted(sizes)}; "
            "every process must hold the same number of data-parallel positions"
        )
    index = {block: i for i, block in enumerate(blocks)}
    return {process: RowBlock(index[(p[0], p[-1] + 1)], len(blocks)) for process, p in held.items()}


def local_rows(index: tuple[slice, ...], block: RowBlock, local: int, total: int) -> Any:
    """The slice of this process's ``local`` rows (block ``block`` of a batch of ``total``
    rows) that the global rows ``index[0]`` are (for ``jax.make_array_from_callback``)."""
    start, stop, _ = index[0].indices(total)
    first = block.index * local
    if start < first or stop > first + local:
        raise ValueError(
            f"rows [{start}, {stop}) of the batch are not in this process's block "
            f"[{first}, {first + local})"
        )
    return (slice(start - first, stop - first), *index[1:])
