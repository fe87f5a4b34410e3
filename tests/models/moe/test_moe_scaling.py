"""Weak scaling of the MoE train step (issue 59): ``config/moe_tiny.yaml`` compiled on 8 CPU
devices with 8x the rows of a one-device compile does one device's share, per device, on
data 8 (no expert axis: every device routes, sorts and multiplies its own tokens) and on
expert 8. Compile only (``bench/moe_scaling.py``, run on 8 fake devices)."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "moe_scaling.py"


@pytest.fixture(scope="module")
def scaling(json_worker):
    return json_worker(BENCH, "--rows", "8", "--model.num_layers=2")


@pytest.mark.slow
def test_data_parallel_moe_does_one_devices_share(scaling):
    ratio = scaling["data8"]["ratio_to_one_device"]
    # the global sort made every device hold the batch's routed rows and all-reduce them
    assert ratio["xla_flops_per_device"] <= 1.15, ratio
    assert ratio["counted_flops_per_device"] <= 1.15, ratio
    assert ratio["temp_bytes_per_device"] <= 1.15, ratio


@pytest.mark.slow
def test_expert_parallel_moe_does_the_routed_work(scaling):
    ratio = scaling["expert8"]["ratio_to_one_device"]
    # the matmuls run the occupied tiles of the receive buffer (4x the routed rows here),
    # counted at their expected trips: the one-device program's work (which pads 16 experts,
    # not 2, to whole tiles) or less
    assert ratio["counted_flops_per_device"] <= 1.3, ratio
    assert ratio["xla_flops_per_device"] <= 1.3, ratio
    # memory: the dropless receive buffer holds 4x the routed rows (1.63x the temporaries at 4 layers);
    # bounded at 1.25x the mean routed rows (drops counted), one device's share
    bounded = scaling["expert8_buffer1.25"]["ratio_to_one_device"]
    assert bounded["temp_bytes_per_device"] <= 1.3, bounded
    assert bounded["counted_flops_per_device"] <= 1.3, bounded
