"""Faults on real processes and real files: kill -9 mid-save, SIGTERM, corrupt and unwritable storage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from loomax.checkpoint import list_checkpoints, load_checkpoint


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory, tiny_corpus, build_data) -> Path:
    """The tokenizer and token cache the runs here share, built before the first run."""
    cache = tmp_path_factory.mktemp("faults-cache")
    build_data(write_config(tmp_path_factory.mktemp("faults-data"), tiny_corpus, cache))
    return cache


def write_config(tmp_path: Path, corpus: Path, cache: Path | None = None, **trainer) -> Path:
    config = {
        "data": {
            "train": [{"urls": [str(corpus)]}],
            "tokenizer_vocab_size": 300,
            "validation_fraction": 0.1,
            "cache_dir": str(cache or tmp_path / "cache"),
        },
        "model": {"seq_len": 32, "hidden_dim": 64, "num_layers": 2, "num_heads": 2},
        # a constant schedule: the step program does not depend on num_train_steps, so the
        # runs here (9 steps, until SIGTERM, resumes) share its compile (persistent cache)
        "optimizer": {"learning_rate": 0.01, "warmup": 2, "lr_schedule": "constant"},
        "trainer": {
            "train_batch_size": 8,
            "log_every": 1,
            "steps_per_eval": 1000,
            "eval_at_start": False,
            "max_eval_batches": 1,
            "progress_bar": False,
            "device_peak_flops": 1e11,  # MFU from this peak: no matmul probe per process
            "run_dir": str(tmp_path / "run"),
            **trainer,
        },
        "sample": {"enabled": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def start(config: Path, *args: str, script: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    program = [str(script)] if script else ["-m", "loomax.cli"]
    return subprocess.Popen(
        [sys.executable, *program, "train", "--config_path", str(config), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    # read while the run appends: a last line without its newline may still be half written
    whole_lines = path.read_text().split("\n")[:-1]
    return [json.loads(line)["step"] for line in whole_lines if line.strip()]


def wait_for(condition, proc: subprocess.Popen, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("timed out")


def read_every_array(checkpoint) -> None:
    arrays = checkpoint.metadata["arrays"]
    template = {n: jax.ShapeDtypeStruct(tuple(e["shape"]), e["dtype"]) for n, e in arrays.items()}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    load_checkpoint(checkpoint, template, {n: device for n in template})


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, train/loss) of every record, in the order written (a resumed run appends)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["train/loss"]) for r in map(json.loads, lines) if "train/loss" in r]


@pytest.mark.slow
def test_kill_9_during_an_async_save_resumes_from_the_last_complete_one(
    tmp_path, tiny_corpus, data_cache
):
    # a checkpoint every 3 steps; the run kills itself while the save of step 6 is in flight
    config = write_config(
        tmp_path,
        tiny_corpus,
        data_cache,
        num_train_steps=9,
        checkpointer={"keep": [{"every": 3}]},
        hooks=[{"type": "test_kill_mid_save", "step": 6}],
    )
    base = tmp_path / "run" / "checkpoints"
    killer = Path(__file__).with_name("kill_mid_save.py")
    proc = start(config, script=killer)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    complete = [c.step for c in list_checkpoints(str(base))]
    assert complete == [3] and (base / "step-6").exists()  # killed mid-save
    assert not (base / "step-6" / "metadata.json").exists()
    first = dict(logged_losses(tmp_path / "run"))

    no_kill = ["--trainer.hooks", "[]"]
    out = finish(start(config, *no_kill))
    assert f"resumed from {base}/step-{complete[-1]} (step {complete[-1]})" in out
    checkpoints = list_checkpoints(str(base))
    assert [c.step for c in checkpoints] == [3, 6, 9]
    for checkpoint in checkpoints:
        read_every_array(checkpoint)  # nothing left corrupt
    # metrics.jsonl holds each step once (the resumed attempt's records replace what the
    # killed one logged after step 3), and the steps run twice (after the last complete
    # checkpoint, before the kill) gave the same loss both times: resuming is exact
    records = logged_losses(tmp_path / "run")
    assert [step for step, _ in records] == sorted({step for step, _ in records})
    redone = [(step, loss) for step, loss in records if complete[-1] < step <= max(first)]
    assert [step for step, _ in redone] == list(range(4, max(first) + 1))
    assert all(loss == first[step] for step, loss in redone)


@pytest.mark.slow
def test_sigterm_saves_at_the_current_step_and_exits_0(tmp_path, tiny_corpus, data_cache):
    config = write_config(tmp_path, tiny_corpus, data_cache, num_train_steps=100000)
    run_dir = tmp_path / "run"
    proc = start(config)
    wait_for(lambda: len(logged_steps(run_dir)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    stopped = max(logged_steps(run_dir))
    assert f"stopping at step {stopped}: signal SIGTERM" in out
    checkpoints = list_checkpoints(str(run_dir / "checkpoints"))
    assert [(c.step, c.permanent) for c in checkpoints] == [(stopped, False)]

    out = finish(start(config, "--trainer.num_train_steps", str(stopped + 2)))
    assert f"(step {stopped})" in out and "resumed from" in out
    assert logged_steps(run_dir)[-2:] == [stopped + 1, stopped + 2]
    steps = [(c.step, c.permanent) for c in list_checkpoints(str(run_dir / "checkpoints"))]
    assert steps == [(stopped + 2, True)]  # the preemption checkpoint was temporary


def test_unwritable_base_path_fails_before_any_work(tmp_path, tiny_corpus, capsys):
    """`loomax train` in this process (its exit code and stderr as a child's would be: a
    refusal before any work needs no JAX process of its own, ~1.5 CPU-s of start-up)."""
    from loomax.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    config = write_config(tmp_path, tiny_corpus, num_train_steps=5)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config_path", str(config),
              "--trainer.checkpointer.base_path", str(blocker / "ckpt")])  # fmt: skip
    out = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "trainer.checkpointer.base_path: cannot write to" in out and "a-file/ckpt" in out
    assert not (tmp_path / "cache").exists()  # stopped before the data was even tokenized


def test_a_save_failing_on_one_process_fails_on_every_process_at_once(tmp_path, processes_support):
    """The failing process tells the others before the commit barrier: nobody waits out the
    barrier's timeout, nothing is committed for that step, the earlier checkpoint stays."""
    from loomax.checkpoint import list_checkpoints
    from loomax.distributed.net import free_port

    worker = Path(__file__).with_name("two_process_save.py")
    base = tmp_path / "checkpoints"

    def scenario(processes):
        port = free_port("")
        for i in range(2):
            processes.start(f"p{i}", [sys.executable, str(worker), str(i), str(port), str(base)])
        outputs = processes.wait(timeout=240)
        return [json.loads(outputs[f"p{i}"].strip().splitlines()[-1]) for i in range(2)]

    results = processes_support.run_scenario(tmp_path, scenario)
    for result in results:
        assert result["1"] == "ok"
        assert "checkpoint step 2 could not be written" in result["2"]
        assert "resumes from the newest, step 1" in result["2"]
        assert result["2_seconds"] < 60  # not the barrier's 600 s timeout
    assert "No space left on device" in results[1]["2"]
    assert "process(es) [1] failed" in results[0]["2"]
    assert [c.step for c in list_checkpoints(str(base))] == [1]
