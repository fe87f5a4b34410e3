"""Which rows of a batch each process loads (``row_blocks``), on device grids of fake
devices: process-major, groups spanning processes, and devices out of order."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.data import BatchLoader, TokenWindows
from loomax.mesh import MeshConfig
from loomax.row_blocks import RowBlock, batch_positions, local_rows, row_blocks


def grid(processes: list[int], shape: tuple[int, ...]) -> np.ndarray:
    """Fake devices of the given processes (in grid order) as a (replica, data, expert,
    context, model) grid of ``shape``."""
    devices = [SimpleNamespace(process_index=p, platform="cpu") for p in processes]
    return np.array(devices, dtype=object).reshape(shape)


def test_processes_of_a_context_group_share_a_block_even_when_not_contiguous():
    # data 2 x context 4 over 4 processes of 2 devices: along each context group the
    # processes alternate, and processes 2 and 3 hold the first row block
    layout = grid([3, 2, 3, 2, 1, 0, 0, 1], (1, 2, 1, 4, 1))
    assert batch_positions(layout) == {0: [1], 1: [1], 2: [0], 3: [0]}
    assert row_blocks(layout) == {
        0: RowBlock(1, 2),
        1: RowBlock(1, 2),
        2: RowBlock(0, 2),
        3: RowBlock(0, 2),
    }
    # context 8 across two processes: one block, loaded by both
    assert row_blocks(grid([0, 1] * 4, (1, 1, 1, 8, 1))) == {0: (0, 1), 1: (0, 1)}
    # plain data parallelism: a block each, in process order
    assert row_blocks(grid([0, 0, 1, 1], (1, 4, 1, 1, 1))) == {0: (0, 2), 1: (1, 2)}


def test_the_blocks_rows_are_what_each_device_of_the_process_holds():
    """Loaded as ``BatchLoader.batch(step, *block)`` and placed by ``local_rows``, every
    device of every process gets exactly the rows of its batch position."""
    layout = grid([3, 2, 3, 2, 1, 0, 0, 1], (1, 2, 1, 4, 1))
    tokens = np.arange(12 * 4, dtype=np.int32)
    loader = BatchLoader(TokenWindows(tokens, 4), 4, seed=0)
    whole = loader.batch(1)
    for process, block in row_blocks(layout).items():
        mine = loader.batch(1, *block)
        assert len(mine) == 2
        for where, device in np.ndenumerate(layout):
            if device.process_index == process:
                rows = slice(where[1] * 2, where[1] * 2 + 2)  # 2 rows per batch position
                local = local_rows((rows, slice(None)), block, local=2, total=4)
                np.testing.assert_array_equal(mine[local], whole[rows])
    with pytest.raises(ValueError, match=r"rows \[0, 2\) .* not in this process's block \[2, 4\)"):
        local_rows((slice(0, 2), slice(None)), RowBlock(1, 2), local=2, total=4)


@pytest.mark.parametrize(
    ("processes", "shape", "message"),
    [
        ([0, 1, 0, 1], (1, 4, 1, 1, 1), r"process 0's devices hold batch positions \[0, 2\]"),
        (
            [0] * 4 + [1] * 4 + [2] * 4,
            (1, 2, 1, 6, 1),
            r"overlapping batch blocks \[0, 1\) and \[0,",
        ),
        ([0, 0, 1, 2], (1, 4, 1, 1, 1), r"blocks of unequal sizes \[1, 2\]"),
    ],
)
def test_layouts_whose_rows_do_not_split_into_blocks_are_refused(
    processes, shape, message, monkeypatch
):
    with pytest.raises(
        ConfigError, match=r"trainer.mesh \(replica, data, expert, context, model, stage"
    ):
        row_blocks(grid(processes, shape))
    with pytest.raises(ConfigError, match=message):
        row_blocks(grid(processes, shape))
    devices = list(grid(processes, shape).flat)
    monkeypatch.setattr(jax, "process_count", lambda: len(set(processes)))  # as on a pod
    with pytest.raises(ConfigError, match=message):  # before any Mesh is made
        MeshConfig(replica=1, data=shape[1], context=shape[3]).build(devices)
