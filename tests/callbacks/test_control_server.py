"""Control server: a real run is stopped (after a save) over real HTTP on 127.0.0.1, with a bearer token."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest

from loomax.callbacks import ControlServerHook


def call(url, method="GET", token=None):
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_save_and_stop_over_http(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=100_000, max_train_time=timedelta(seconds=120))
    hook = ControlServerHook(run_dir=trainer.run_dir, port=0)
    trainer.add_hook(hook)
    control_file = trainer.run_dir / "control.json"
    replies = {}

    def client():
        while not control_file.exists():
            time.sleep(0.05)
        info = json.loads(control_file.read_text())
        url, token = info["url"], info["token"]
        assert url.startswith("http://127.0.0.1:")
        replies["no token"] = call(url + "/status")
        replies["wrong token"] = call(url + "/stop", "POST", token="nope")
        while True:
            replies["status"] = call(url + "/status", token=token)
            if (replies["status"][1].get("step") or 0) >= 3:
                break
            time.sleep(0.05)
        replies["unknown"] = call(url + "/explode", "POST", token=token)
        replies["save_and_stop"] = call(url + "/save_and_stop", "POST", token=token)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    final = trainer.train(tiny.init(trainer), tiny.batches())
    thread.join(timeout=30)
    trainer.finish()
    assert replies["no token"][0] == 401 and replies["wrong token"][0] == 401
    assert replies["status"][0] == 200 and replies["status"][1]["state"] == "training"
    assert replies["unknown"][0] == 404
    assert replies["save_and_stop"] == (202, {"accepted": "save_and_stop"})
    assert 3 <= final.step < 1000
    assert trainer.stop_reason == "save_and_stop over HTTP (requested by control server)"
    checkpoint = tmp_path / "run" / "checkpoints" / f"step-{final.step}" / "metadata.json"
    assert json.loads(checkpoint.read_text())["permanent"]  # asked for: kept
    assert not control_file.exists()  # removed when the server stops


@pytest.mark.slow
def test_only_process_0_serves_and_the_stop_reaches_every_process(tmp_path):
    worker = Path(__file__).with_name("control_worker.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), "2", str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        control_file = tmp_path / "control.json"
        deadline = time.monotonic() + 240
        while not control_file.exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
        served = json.loads(control_file.read_text())
        while (call(served["url"] + "/status", token=served["token"])[1].get("step") or 0) < 3:
            assert all(p.poll() is None for p in procs)
            time.sleep(0.05)
        assert call(served["url"] + "/save_and_stop", "POST", token=served["token"])[0] == 202
        results = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r["process_index"] for r in results] == [0, 1]
    assert results[0]["final_step"] == results[1]["final_step"] < 100_000
    for r in results:
        assert r["stop_reason"] == "save_and_stop over HTTP (requested by control server)"
        assert r["saved_step"] == r["final_step"]
