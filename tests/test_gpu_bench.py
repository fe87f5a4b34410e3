"""bench/gpu.py, the GPU checks and benchmarks: its sections run (at toy sizes) on CPU too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_gpu_script(repo_root, tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(repo_root / "bench" / "gpu.py"), "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_attention_section_at_toy_sizes(repo_root, tmp_path):
    proc = run_gpu_script(repo_root, tmp_path, "--smoke", "--only", "attention", "--budget", "400")
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_results.json").read_text())
    assert results["env"]["status"] == "ok" and results["env"]["backend"] == "cpu"
    attention = results["attention"]
    assert attention["status"] == "ok" and attention["ok"], attention
    assert [c["case"] for c in attention["cases"]] == [
        "causal/mha",
        "causal/gqa",
        "documents/mha",
        "documents/gqa",
    ]
    # off NVIDIA GPUs, auto never picks cuDNN, and says why
    assert {f["auto"] for f in attention["fallbacks"]} == {"vanilla"}
    assert all("no NVIDIA GPU" in f["reason"] for f in attention["fallbacks"])
    assert "attention" in proc.stdout and "worst rel err" in proc.stdout  # the table


def test_unknown_section_is_refused(repo_root, tmp_path):
    proc = run_gpu_script(repo_root, tmp_path, "--only", "attention,warp-drive")
    assert proc.returncode == 2 and "warp-drive" in proc.stderr


def test_table_of_a_recorded_h200_run(repo_root):
    """The table renders the results a real run wrote (bench/results), partial sections too."""
    sys.path.insert(0, str(repo_root / "bench"))
    try:
        import gpu
    finally:
        sys.path.pop(0)
    results = json.loads((repo_root / "bench" / "results" / "gpu_h200_run2.json").read_text())
    text = gpu.table(results)
    assert "NVIDIA H200" in text and "torch.compile" in text
    assert gpu.best_gpt2(results)["name"] == "gpt2-ntg-remat-unroll"
