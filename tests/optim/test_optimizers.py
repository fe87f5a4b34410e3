"""The optimizer contract: every registered optimizer trains, checkpoints exactly, and shards.

One suite over every ``optimizer.type``: a few steps on a tiny GPT-2 lower the loss, the
final checkpoint restores bitwise (optimizer state included; resharding on load is the
checkpointer's own test), and the same run on an 8-device FSDP mesh (fake CPU devices, in a subprocess) follows the same losses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loomax.optim import OptimizerConfig

WORKER = Path(__file__).with_name("optimizer_run.py")
_spec = importlib.util.spec_from_file_location("optimizer_run", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def test_every_registered_optimizer_is_in_the_contract():
    registered = set(OptimizerConfig.get_known_choices())
    covered = {OptimizerConfig.get_choice_name(type(c)) for c in worker.OPTIMIZERS.values()}
    assert registered == covered >= {"adam", "lion", "adafactor", "muon"}
    assert set(worker.SETTINGS) <= covered


@pytest.fixture(scope="module")
def sharded_process():
    """The same runs on a mesh of 8 fake CPU devices (FSDP: data=8), started early to overlap."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "8"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def sharded_runs(sharded_process):
    out, err = sharded_process.communicate(timeout=600)
    assert sharded_process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single_runs(sharded_process):
    return {name: worker.run(name) for name in worker.OPTIMIZERS}


@pytest.mark.parametrize("name", list(worker.OPTIMIZERS))
def test_loss_decreases(single_runs, name):
    run = single_runs[name]
    assert run["finite"]
    assert len(run["losses"]) == worker.STEPS
    assert run["losses"][-1] < run["losses"][0] - 0.05, run["losses"]


@pytest.mark.parametrize("name", list(worker.OPTIMIZERS))
def test_state_checkpoints_and_restores_exactly(single_runs, name):
    run = single_runs[name]
    assert run["restored_step"] == worker.STEPS
    assert run["restored_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(worker.OPTIMIZERS))
def test_same_losses_under_8_device_fsdp(single_runs, sharded_runs, name):
    sharded = sharded_runs[name]
    assert "data" in sharded["mlp_up_spec"]  # parameters (and so optimizer state) are split
    np.testing.assert_allclose(sharded["losses"], single_runs[name]["losses"], rtol=2e-4)
