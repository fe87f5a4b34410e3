"""Stop/save/eval agreement: across real JAX processes (CPU, jax.distributed on 127.0.0.1), and
the keys it keeps in the coordination service (a fake one)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from loomax.distributed.net import free_port
from loomax.train import control

WORKER = Path(__file__).with_name("two_trains_run.py")


@pytest.mark.slow
def test_second_train_call_does_not_see_the_first_calls_decisions(tmp_path, processes_support):
    # `loomax ladder run` trains several models in the same processes: the stop process 1
    # asked for in the first call (and the first call's per-step decisions, still in the
    # coordination service) must not stop, or break, the second.
    # Neither run is given a run id: the processes agree on process 0's, which for the
    # second is the one its run dir records (a rerun of the same command continues it).
    def scenario(processes):
        (processes.directory / "runs" / "second").mkdir(parents=True)
        (processes.directory / "runs" / "second" / "run_id").write_text("recorded-7\n")
        port = free_port("")
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        for i in range(2):
            args = [str(i), "2", str(port), str(processes.directory / "runs")]
            processes.start(f"process{i}", [sys.executable, str(WORKER), *args], env)
        outputs = processes.wait(timeout=600)
        first_record = (processes.directory / "runs" / "first" / "run_id").read_text()
        return [
            json.loads(outputs[f"process{i}"].strip().splitlines()[-1]) for i in range(2)
        ], first_record

    results, first_record = processes_support.run_scenario(tmp_path, scenario)
    (first0, second0), (first1, second1) = results
    assert first0 == first1 and first0["final_step"] in (2, 3)  # process 0 learns of it at 2 or 3
    assert "asked by the test" in first0["stop_reason"]
    assert second0 == second1 == {"final_step": 4, "stop_reason": None, "run_id": "recorded-7"}
    assert first0["run_id"] != "recorded-7"  # process 0's clock, the same on both
    assert first_record == first0["run_id"] + "\n"  # recorded, for a rerun to continue


class FakeClient:
    """The coordination service's key-value store, as process 0 sees it."""

    def __init__(self) -> None:
        self.store: dict[str, str] = {}

    def key_value_set(self, key: str, value: str) -> None:
        if key in self.store:
            raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
        self.store[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return sorted((k, v) for k, v in self.store.items() if k.startswith(prefix))

    def key_value_delete(self, key: str) -> None:
        for k in [k for k in self.store if k == key or (key.endswith("/") and k.startswith(key))]:
            del self.store[k]


def test_each_agreement_has_its_own_keys_and_clears_the_earlier_ones(monkeypatch):
    client = FakeClient()
    monkeypatch.setattr(control, "coordination_client", lambda: client)
    monkeypatch.setattr(control, "_cleared_below", 0)  # as in a fresh process
    first = control.StepAgreement()
    assert first.agree(1, control.Decision()) == control.Decision()
    (step_key,) = client.store
    client.store[step_key.removesuffix("step/1") + "stop/1"] = "signal SIGTERM"  # process 1 asks
    assert first.agree(2, control.Decision()).stop == "signal SIGTERM (process 1)"
    left_by_first = set(client.store)

    second = control.StepAgreement()  # the next train call: the same step numbers again
    for step in range(1, control._KEEP_STEPS + 1):
        assert second.agree(step, control.Decision()) == control.Decision()
    assert not left_by_first & set(client.store)  # every process is past the first call by now
    second.agree(control._KEEP_STEPS + 1, control.Decision(eval=True))
    steps = sorted(int(k.rsplit("/", 1)[-1]) for k in client.store)
    assert steps == list(range(2, control._KEEP_STEPS + 2))  # the last ones, of this call only
