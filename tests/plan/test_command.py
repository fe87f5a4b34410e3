"""The `loomax compile` / `loomax plan` command lines: help, bad input, DOES NOT FIT."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loomax.cli import main
from loomax.plan import topology as topology_module
from loomax.plan.topology import TopologyError, check_libtpu, parse_topology_name

requires_libtpu = pytest.mark.usefixtures("libtpu")  # fails, not skips, without it


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loomax.cli", *args], capture_output=True, text=True, cwd=cwd
    )


@pytest.mark.parametrize("command", ["compile", "plan"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: loomax {command} ")


def test_topology_names():
    assert parse_topology_name("v5p:4x4x8") == (1, "v5p", (4, 4, 8))
    assert parse_topology_name("2xv5e:4x4") == (2, "v5e", (4, 4))
    for bad in ("v5p:4x4", "tpu-v9:2x2", "v5e-16", "v6e:2x2x2"):
        with pytest.raises(TopologyError, match="valid forms: v4:AxBxC"):
            parse_topology_name(bad)


def test_unknown_topology_is_a_clear_error_before_any_compile(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "--topology", "v9x:2x2", "--model.vocab_size", "512"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown topology 'v9x:2x2'" in err and "v5p:AxBxC" in err


@requires_libtpu
def test_a_mesh_that_does_not_divide_the_chips_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "--topology", "v5e:2x2", "--trainer.mesh.model", "3"])
    assert exit_info.value.code == 2
    assert "do not divide the 4 devices (topology v5e:2x2)" in capsys.readouterr().err


def test_a_vocabulary_that_needs_a_download_is_asked_for(capsys, repo_root, tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))  # nothing cached
    config = str(repo_root / "config" / "gpt2_small.yaml")
    unknown = ["--data.tokenizer", "some-org/some-tokenizer"]  # a hub id of no known size
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "--config_path", config, "--topology", "v5e:2x2", *unknown])
    assert exit_info.value.code == 2
    assert "pass --model.vocab_size N" in capsys.readouterr().err


def test_missing_libtpu_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu -> ImportError
    with pytest.raises(TopologyError, match=r"pip install 'loomax\[tpu\]'"):
        check_libtpu()
    with pytest.raises(TopologyError, match="loomax"):
        topology_module.get_topology("v5e:2x2")


@requires_libtpu
@pytest.mark.slow
def test_llama_8b_on_one_v5e_chip_does_not_fit(tmp_path, repo_root):
    done = run_cli(
        "compile",
        "--config_path",
        str(repo_root / "config" / "llama_8b.yaml"),
        "--topology",
        "v5e:1x1",
        "--trainer.train_batch_size",
        "1",
        "--out",
        str(tmp_path / "report.json"),
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "DOES NOT FIT" in done.stdout
    assert "8,030.3M parameters" in done.stdout
    assert "TPU_WORKER_HOSTNAMES" not in done.stderr  # libtpu's probe is answered, not printed
    assert (tmp_path / "report.json").is_file()


TINY_LLAMA = (
    "--model.type", "llama", "--model.hidden_dim", "64", "--model.intermediate_dim", "128",
    "--model.seq_len", "64", "--model.num_layers", "2", "--model.vocab_size", "512",
    "--trainer.train_batch_size", "8",
)  # fmt: skip


@requires_libtpu
def test_compile_prints_its_range_and_assumptions(tmp_path, capsys, monkeypatch):
    """`loomax compile` prints the estimate as a range with its assumptions; the JSON report
    keeps the keys scripts read (``est_step_s``: the expected end) and adds the range.
    The command's own ``main``, in this process (the subprocess above checks the process
    edge: libtpu's probe, the exit code of DOES NOT FIT)."""
    import json

    # the compile child at libtpu's quick effort (conftest.py's quick_compiles): the checks
    # read the range's order and the report's keys, not the optimized program
    monkeypatch.setenv("JAX_EXEC_TIME_OPTIMIZATION_EFFORT", "-1")
    report = tmp_path / "report.json"
    main(["compile", "--topology", "v5p:2x2x1", *TINY_LLAMA, "--load_max", "1.25", "--out", str(report)])  # fmt: skip
    out = capsys.readouterr().out
    assert "estimated step time (best / expected / worst): " in out
    assert "estimated MFU: " in out and "(causal attention as half)" in out
    assert "assumptions:\n  - compute: every op alike (XLA's and Pallas kernels)" in out
    assert "\n  - communication: " in out and "\n  - not modelled: " in out
    data = json.loads(report.read_text())
    for key in ("est_step_s", "est_mfu", "est_kernel_s", "estimate", "model_flops"):
        assert key in data
    assert data["est_best_s"] <= data["est_step_s"] <= data["est_worst_s"]
    assert data["load_max"] == 1.25 and data["assumptions"]


def test_a_load_below_the_mean_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "--topology", "v5e:2x2", *TINY_LLAMA, "--load_max", "0.5"])
    assert exit_info.value.code == 2
    assert "--load_max is the busiest load over the mean" in capsys.readouterr().err
