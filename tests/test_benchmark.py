"""loomax bench: runs a config on synthetic data and ends with one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_prints_json_line(tmp_path):
    config = tmp_path / "bench.yaml"
    config.write_text(
        "model:\n  type: gpt2\n  seq_len: 32\n  hidden_dim: 32\n  num_layers: 1\n  num_heads: 2\n  vocab_size: 100\n"
        "  document_mask: true\n"  # timed with documents masked at a synthetic EOS
        "trainer:\n  train_batch_size: 4\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loomax.cli",
            "bench",
            "--config_path",
            str(config),
            "--steps",
            "3",
            "--warmup",
            "1",
            "--save_every",
            "2",
            "--profile",
            str(tmp_path / "profile"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("compile_s", "step_ms_median", "tokens_per_second", "flops_per_token", "mfu"):
        assert key in result
    assert result["tokens_per_second"] > 0 and 0 < result["mfu"] < 1
    assert result["save_every"] == 2 and result["checkpoint_mb"] > 0  # timed with saves too
    assert result["step_ms_mean_saving"] > 0 and "checkpoint_overhead" in result
    # a few steps traced after the timing (the donated state survives the saves), for Perfetto too
    assert result["profile_dir"] == str(tmp_path / "profile") and "profile_error" not in result
    assert list((tmp_path / "profile").rglob("*.trace.json.gz"))
    assert "device_peak_gb" not in result  # CPUs report no device memory
    # which CPU kernel libraries the compiled step calls, and a fingerprint of its HLO
    assert set(result["hlo_library_calls"]) == {"onednn", "xnn", "ynn"}
    assert len(result["hlo_fingerprint"]) == 12 and "xla_flags" in result
    # causal attention as half the score matrix (2 x seq x d), the full square under its own key
    dense = 2 * 32 * 96 + 2 * 32 * 32 + 4 * 32 * 128 + 2 * 32 * 100
    assert result["flops_per_token"] == 3 * (dense + 2 * 32 * 32)
    assert result["flops_per_token_full_attention"] == 3 * (dense + 4 * 32 * 32)


def test_bench_needs_vocab_size(tmp_path, capsys):
    import pytest

    from loomax.cli import main

    config = tmp_path / "bench.yaml"
    config.write_text(
        "model:\n  type: gpt2\n  seq_len: 32\n  hidden_dim: 32\n  num_layers: 1\n  num_heads: 2\n"
    )
    with pytest.raises(SystemExit) as exit:  # the CLI's own exit, in this process
        main(["bench", "--config_path", str(config)])
    assert exit.value.code == 2 and "model.vocab_size" in capsys.readouterr().err
