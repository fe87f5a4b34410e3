"""A preempted TPU VM is recreated before the retry.

No TPU (nor GCP) can be reached from here, so ``gcloud`` is a recording stub on PATH: it
keeps the VM's state in a file, records every call, and reports the VM preempted when
the first run fails. Everything else (the launcher, its retries, the subprocesses) is real.
"""

from __future__ import annotations

import json
import sys

import pytest

from loomax.cli import main

FAKE_GCLOUD = """#!{python}
import json, pathlib, sys
here = pathlib.Path({state_dir!r})
args = sys.argv[1:]
with (here / "calls.jsonl").open("a") as f:
    f.write(json.dumps(args) + "\\n")
state, runs = here / "state", here / "runs"
verb = args[3]
if verb == "describe":
    if not state.exists():
        sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND")
    print(state.read_text())
elif verb == "delete":
    state.unlink()
elif verb == "create":
    state.write_text("READY")
elif verb == "ssh":
    command = args[args.index("--command") + 1]
    if "loomax" in command:
        n = int(runs.read_text()) + 1 if runs.exists() else 1
        runs.write_text(str(n))
        if n == 1:  # the first run is preempted
            state.write_text("PREEMPTED")
            sys.exit(255)
"""


@pytest.fixture
def gcloud(tmp_path, monkeypatch):
    """A fake ``gcloud`` on PATH; returns its directory (``calls.jsonl``, ``state``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "gcloud"
    script.write_text(FAKE_GCLOUD.format(python=sys.executable, state_dir=str(tmp_path)))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOOMAX_GIT_COMMIT", "abc123")
    return tmp_path


def calls(state_dir) -> list[list[str]]:
    lines = (state_dir / "calls.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


OPTIONS = [
    "--target", "tpu", "--tpu_name", "t1", "--zone", "us-central2-b",
    "--accelerator_type", "v4-8", "--runtime_version", "tpu-ubuntu2204-base", "--spot",
    "--setup_command", "setup-workers", "--run_id", "r1",
]  # fmt: skip


def test_a_preempted_vm_is_recreated_with_the_same_settings_before_the_retry(gcloud):
    (gcloud / "state").write_text("READY")
    with pytest.raises(SystemExit) as exit:
        main(["launch", *OPTIONS, "--retries", "1", "--", "train"])
    assert exit.value.code == 0
    vm = ["compute", "tpus", "tpu-vm"]
    where = ["t1", "--zone", "us-central2-b"]
    made = calls(gcloud)
    assert [c[3] for c in made] == ["describe", "ssh", "describe", "delete", "create", "ssh", "ssh"]
    assert made[0] == [*vm, "describe", *where, "--format=value(state)"]
    assert made[3] == [*vm, "delete", *where, "--quiet"]
    assert made[4] == [
        *vm, "create", *where, "--accelerator-type", "v4-8",
        "--version", "tpu-ubuntu2204-base", "--spot",
    ]  # fmt: skip
    assert made[5] == [*vm, "ssh", *where, "--worker=all", "--command", "setup-workers"]
    assert made[1] == made[6]  # the same run, on the new VM
    assert made[6][-1].endswith(".venv/bin/loomax train --trainer.run_id r1")


def test_a_missing_vm_is_created_first(gcloud):
    with pytest.raises(SystemExit) as exit:
        main(["launch", *OPTIONS, "--", "train"])
    assert exit.value.code == 255  # created, then its first run is preempted; no retries left
    assert [c[3] for c in calls(gcloud)] == ["describe", "create", "ssh", "ssh"]


def test_without_accelerator_type_nothing_is_created(gcloud):
    with pytest.raises(SystemExit) as exit:
        main(["launch", "--target", "tpu", "--tpu_name", "t1", "--zone", "z", "--", "train"])
    assert exit.value.code == 255
    assert [c[3] for c in calls(gcloud)] == ["ssh"]
