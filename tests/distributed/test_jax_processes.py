"""DistributedConfig takes unset settings from the LOOMAX_* variables `loomax launch` sets."""

from __future__ import annotations

import pytest

from loomax.distributed import DistributedConfig


def test_launch_variables_fill_unset_fields(monkeypatch):
    monkeypatch.setenv("LOOMAX_COORDINATOR_ADDRESS", "10.0.0.1:8476")
    monkeypatch.setenv("LOOMAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("LOOMAX_PROCESS_ID", "2")
    monkeypatch.setenv("LOOMAX_LOCAL_DEVICE_IDS", "0,1")
    resolved = DistributedConfig().resolved()
    assert (resolved.coordinator_address, resolved.num_processes, resolved.process_id) == (
        "10.0.0.1:8476",
        4,
        2,
    )
    assert resolved.local_device_ids == [0, 1] and resolved.explicit
    explicit = DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=0)
    assert explicit.resolved().coordinator_address == "h:1"  # explicit settings win
    assert explicit.resolved().process_id == 0


def test_no_variables_no_distributed(monkeypatch):
    for name in ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID", "LOCAL_DEVICE_IDS"):
        monkeypatch.delenv(f"LOOMAX_{name}", raising=False)
    assert not DistributedConfig().explicit


def test_malformed_variable_is_named(monkeypatch):
    monkeypatch.setenv("LOOMAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="LOOMAX_NUM_PROCESSES='two' is malformed"):
        DistributedConfig().resolved()


def test_process_id_out_of_range_is_named(monkeypatch):
    monkeypatch.setenv("LOOMAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("LOOMAX_PROCESS_ID", "5")
    with pytest.raises(ValueError, match=r"process_id \(5\) must be in \[0, num_processes=2\)"):
        DistributedConfig().resolved()
