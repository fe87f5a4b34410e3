"""The downstream_eval hook in a real run over two JAX processes (2 CPU devices each, the
model sharded over both): the same scores as one process with the same four devices."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from loomax.distributed.net import free_port

# in the test extra: fails, not skips, without it
pytestmark = pytest.mark.usefixtures("needs_lm_eval")

WORKER = Path(__file__).with_name("multiprocess_run.py")


def env(devices: int) -> dict[str, str]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


@pytest.mark.slow
def test_two_processes_score_as_one(tasks_dir, tokenizer_path, tmp_path, processes_support):
    def scenario(processes):
        # the one-process reference runs beside the pair, not before it: the cores the
        # pair leaves idle while it waits on its collectives serve the reference
        processes.start("single", [sys.executable, str(WORKER), "single", str(tasks_dir),
                                   str(tokenizer_path), str(processes.directory / "single")],
                        env(4))  # fmt: skip
        port = free_port("")
        for i in range(2):
            args = ["process", str(i), "2", str(port), str(tasks_dir), str(tokenizer_path),
                    str(processes.directory / "run")]  # fmt: skip
            processes.start(f"p{i}", [sys.executable, str(WORKER), *args], env(2))
        out = processes.wait(timeout=600)
        return [json.loads(out[name].strip().splitlines()[-1]) for name in ("single", "p0", "p1")]

    want, *got = processes_support.run_scenario(tmp_path / "two", scenario)
    assert want["processes"] == 1 and want["devices"] == 4
    # a JAX run's evaluation imports no torch (lm-eval's env report, its torch seed)
    assert not any(r["torch_imported"] for r in [want, *got])
    assert "model" in want["mlp_up_spec"]  # the weights are split over the model axis
    for result in got:
        assert result["processes"] == 2 and result["devices"] == 4
        assert result["mlp_up_spec"] == want["mlp_up_spec"]
        assert result["step"] == want["step"] == 2
        assert set(result["metrics"]) == set(want["metrics"])
        for key, value in want["metrics"].items():
            if "acc" in key or "exact_match" in key:
                assert result["metrics"][key] == value, key
            else:
                assert result["metrics"][key] == pytest.approx(value, rel=1e-5), key
    assert "downstream/tiny_ppl/bits_per_byte" in want["metrics"]
