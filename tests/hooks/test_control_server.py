"""Control server: a real run is stopped (after a save) or aborted (no save) over real HTTP on
127.0.0.1, with a bearer token; `loomax control RUN_DIR ...` is its client."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from loomax.cli import main
from loomax.distributed.net import free_port
from loomax.hooks import ControlServerHook, LogMetricsHook, control_server
from loomax.hooks.control_server import RunAborted
from loomax.train.hooks import StepInfo


def call(url, method="GET", token=None):
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class ClientThread(threading.Thread):
    """Runs `target` in a thread; `result` joins it with a deadline and re-raises its error."""

    def __init__(self, target) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as error:  # re-raised in the test's thread by `result`
            self.error = error

    def result(self, timeout: float) -> None:
        self.join(timeout=timeout)
        assert not self.is_alive(), f"the client thread is still running after {timeout}s"
        if self.error is not None:
            raise self.error


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.05)


def test_control_file_appears_only_whole_and_private(tmp_path, monkeypatch):
    # A client polls for control.json and reads it at once: the name must not exist before
    # the URL and token are in it (CI once read it empty, between create and write).
    hook = ControlServerHook(run_dir=tmp_path / "run")
    existed_while_writing = []

    def dump(obj, f):
        existed_while_writing.append(hook.control_file.exists())
        json.dump(obj, f)

    fake_json = SimpleNamespace(dump=dump, dumps=json.dumps)
    monkeypatch.setattr(control_server, "json", fake_json)
    hook.on_train_begin(StepInfo(step=0, state=None, metrics={}))
    try:
        assert existed_while_writing == [False]
        assert hook.control_file.stat().st_mode & 0o777 == 0o600
        assert sorted(p.name for p in hook.run_dir.iterdir()) == ["control.json"]  # no temp left
        info = json.loads(hook.control_file.read_text())
        assert call(info["url"] + "/status", token=info["token"])[0] == 200
    finally:
        hook.on_train_end(StepInfo(step=0, state=None, metrics={}))
    assert not hook.control_file.exists()


def test_save_and_stop_over_http(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=100_000, max_train_time=timedelta(seconds=120))
    hook = ControlServerHook(run_dir=trainer.run_dir, port=0)
    trainer.add_hook(hook)
    control_file = trainer.run_dir / "control.json"
    replies = {}

    def client():
        wait_for(control_file.exists, 60, "control.json")
        info = json.loads(control_file.read_text())
        url, token = info["url"], info["token"]
        assert url.startswith("http://127.0.0.1:")
        replies["no token"] = call(url + "/status")
        replies["wrong token"] = call(url + "/stop", "POST", token="nope")

        def at_step_3():
            replies["status"] = call(url + "/status", token=token)
            return (replies["status"][1].get("step") or 0) >= 3

        wait_for(at_step_3, 60, "step 3")
        replies["unknown"] = call(url + "/explode", "POST", token=token)
        replies["save_and_stop"] = call(url + "/save_and_stop", "POST", token=token)

    thread = ClientThread(client)

    def stop_if_the_client_failed(info):  # fail in seconds, not at max_train_time
        if thread.error is not None:
            info.control.stop("the test's client failed", by="test")

    trainer.add_hook(stop_if_the_client_failed, every=1)
    thread.start()
    final = trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    thread.result(timeout=30)
    assert replies["no token"][0] == 401 and replies["wrong token"][0] == 401
    assert replies["status"][0] == 200 and replies["status"][1]["state"] == "training"
    assert replies["unknown"][0] == 404
    assert replies["save_and_stop"] == (202, {"accepted": "save_and_stop"})
    assert 3 <= final.step < 1000
    assert trainer.stop_reason == "save_and_stop over HTTP (requested by control server)"
    checkpoint = tmp_path / "run" / "checkpoints" / f"step-{final.step}" / "metadata.json"
    assert json.loads(checkpoint.read_text())["permanent"]  # asked for: kept
    assert not control_file.exists()  # removed when the server stops


COMMANDS = ("save_and_stop", "abort")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, processes_support) -> dict[str, list[dict]]:
    """One pair of JAX processes (process 0 serves HTTP) trains a run per command, one after
    the other, each stopped by its command over HTTP at step 3 or later: each process's
    result of each run, by command. (One JAX start of the pair serves both commands.)"""
    worker = Path(__file__).with_name("control_worker.py")
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1",
    }

    def scenario(processes) -> dict[str, list[dict]]:
        port = free_port("")  # the JAX coordinator's: retried once if taken meanwhile
        run_dir = processes.directory / "run"
        for i in range(2):
            args = [sys.executable, str(worker), str(i), "2", str(port), str(run_dir), *COMMANDS]
            processes.start(f"worker{i}", args, env=env)
        for command in COMMANDS:
            control_file = run_dir / command / "control.json"
            deadline = time.monotonic() + 240
            while not control_file.exists():
                processes.check_running()
                assert time.monotonic() < deadline, f"no {control_file} after 240s"
                time.sleep(0.1)
            served = json.loads(control_file.read_text())
            url, token = served["url"], served["token"]
            while (call(url + "/status", token=token)[1].get("step") or 0) < 3:
                processes.check_running()
                assert time.monotonic() < deadline, f"{command} run not at step 3 after 240s"
                time.sleep(0.05)
            assert call(url + f"/{command}", "POST", token=token)[0] == 202
        outputs = processes.wait(timeout=240)
        lines = [[json.loads(x) for x in outputs[f"worker{i}"].split("\n") if x.startswith("{")]
                 for i in range(2)]  # fmt: skip
        return {c: [lines[i][n] for i in range(2)] for n, c in enumerate(COMMANDS)}

    return processes_support.run_scenario(tmp_path_factory.mktemp("control"), scenario)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_only_process_0_serves_and_the_stop_reaches_every_process(command, two_process_runs):
    results = two_process_runs[command]
    assert [r["command"] for r in results] == [command, command]
    assert [r["process_index"] for r in results] == [0, 1]
    if command == "abort":  # every process fails at the same step, and none saved
        assert results[0]["aborted"] == results[1]["aborted"]
        assert results[0]["aborted"].endswith(": no checkpoint saved")
        assert [r["saved_step"] for r in results] == [None, None]
        return
    assert results[0]["final_step"] == results[1]["final_step"] < 100_000
    for r in results:
        assert r["stop_reason"] == "save_and_stop over HTTP (requested by control server)"
        assert r["saved_step"] == r["final_step"]


def test_loomax_control_reads_status_then_aborts_without_a_save(tiny, tmp_path, capsys):
    trainer = tiny.trainer(tmp_path, steps=100_000, max_train_time=timedelta(seconds=120))
    trainer.add_hook(ControlServerHook(run_dir=trainer.run_dir, max_steps=100_000))
    trainer.add_hook(LogMetricsHook(every=2, tokens_per_step=64))
    run_dir = str(trainer.run_dir)
    replies = {}

    def client():
        wait_for(lambda: (trainer.run_dir / "control.json").exists(), 60, "control.json")

        def logged():
            main(["control", run_dir, "status"])
            replies["status"] = json.loads(capsys.readouterr().out)
            return "train/loss" in replies["status"]["metrics"]

        wait_for(logged, 60, "logged metrics in /status")
        main(["control", run_dir, "abort"])
        replies["abort"] = json.loads(capsys.readouterr().out)

    thread = ClientThread(client)

    def stop_if_the_client_failed(info):
        if thread.error is not None:
            info.control.stop("the test's client failed", by="test")

    trainer.add_hook(stop_if_the_client_failed, every=1)
    thread.start()
    with pytest.raises(RunAborted, match=r"aborted over HTTP at step \d+: no checkpoint saved"):
        trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    thread.result(timeout=30)
    status = replies["status"]
    assert status["max_steps"] == 100_000 and status["logged_step"] % 2 == 0
    assert status["metrics"]["train/loss"] > 0 and status["state"] == "training"
    assert replies["abort"] == {"accepted": "abort"}
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").glob("step-*")
    )
    assert not (tmp_path / "run" / "control.json").exists()


def test_loomax_control_without_a_server_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["control", str(tmp_path), "status"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("loomax control: error: ") and "control.json not found" in err
    assert err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["control", "--help"])
    assert exit_info.value.code == 0
    assert "abort" in capsys.readouterr().out
