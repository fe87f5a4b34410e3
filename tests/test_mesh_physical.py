"""Meshes laid out by the physical topology: TPU slices and tori compiled on the CPU host."""

from __future__ import annotations

import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.mesh import MeshConfig
from loomax.row_blocks import RowBlock, row_blocks

pytestmark = pytest.mark.usefixtures("libtpu")


@pytest.fixture(scope="module")
def topology():
    from loomax.plan.topology import get_topology

    return lambda name: get_topology(name).devices


def axes_varied(group) -> int:
    """Along how many physical axes the chips of ``group`` differ."""
    coords = np.array([d.coords for d in np.ravel(group)])
    return int((coords.max(axis=0) > coords.min(axis=0)).sum())


def test_replica_goes_across_slices_and_groups_stay_within_one(topology):
    devices = topology("2xv5p:4x4x4")
    mesh = MeshConfig(replica=2, data=-1, model=4).build(devices)
    assert dict(mesh.shape) == {
        "replica": 2,
        "data": 16,
        "expert": 1,
        "context": 1,
        "model": 4,
        "stage": 1,
    }
    for r in range(2):  # each replica is one slice: its data and model groups use ICI only
        assert {d.slice_index for d in mesh.devices[r].flat} == {r}
    assert all(axes_varied(mesh.devices[r, i]) == 1 for r in range(2) for i in range(16))


def test_a_model_group_is_a_ring_along_one_torus_axis(topology):
    devices = topology("v5p:4x4x4")
    mesh = MeshConfig(replica=1, data=-1, model=4).build(devices)
    assert all(axes_varied(mesh.devices[0, i]) == 1 for i in range(16))
    in_order = np.array(devices, dtype=object).reshape(1, 16, 4)  # the old layout: a 2x2 square
    assert axes_varied(in_order[0, 0]) == 2


def test_fewer_replicas_than_slices_is_refused(topology):
    with pytest.raises(
        ConfigError, match=r"trainer.mesh.replica \(1\) must be a multiple of the 2"
    ):
        MeshConfig(replica=1, data=-1, model=1).build(topology("2xv5p:4x4x4"))


def test_the_128k_layout_shares_each_row_block_between_two_hosts(topology):
    """``llama_8b_128k.yaml`` on v5p-128 (16 hosts of 4 chips): data 8 x context 8 on the
    torus; each context group spans two hosts, which load the same eighth of the batch."""
    mesh = MeshConfig(data=8, context=8).build(topology("v5p:4x4x4"))
    blocks = row_blocks(mesh.devices)
    assert set(blocks.values()) == {RowBlock(i, 8) for i in range(8)}
    for group in mesh.devices.reshape(8, 8):  # a batch position's context group
        hosts = {d.process_index for d in group}
        assert len(hosts) == 2 and len({blocks[h] for h in hosts}) == 1
    assert any(blocks[p].index != p // 2 for p in blocks)  # not derivable from the index
