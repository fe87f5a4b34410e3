"""Meshes laid out by the physical topology: TPU slices and tori compiled on the CPU host."""

from __future__ import annotations

import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.mesh import MeshConfig

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
    assert dict(mesh.shape) == {"replica": 2, "data": 16, "expert": 1, "context": 1, "model": 4}
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
