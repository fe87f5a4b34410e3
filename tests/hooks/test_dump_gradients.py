"""Gradient dumps: a real run writes the listed steps' gradients to safetensors; with two
processes (FSDP over both) the file holds the whole gradient, gathered from both (and the
memory hook reports both processes, and trainer.log_dir gives each its log file)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from loomax.config import ConfigError
from loomax.distributed.net import free_port
from loomax.hooks import DumpGradientsHook, LogMetricsHook
from loomax.tree_paths import named_leaves


def norm(tensors: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(t.astype(np.float64) ** 2) for t in tensors.values())))


def test_listed_steps_are_written_whole_or_only_the_chosen_parameters(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=3)
    run_dir = trainer.run_dir
    trainer.add_hook(DumpGradientsHook(steps=[2, 3], run_dir=run_dir))
    mlp = DumpGradientsHook(steps=[3], include=["blocks/*/mlp/*"], directory="mlp", run_dir=run_dir)
    trainer.add_hook(mlp)
    trainer.add_hook(LogMetricsHook(every=1, tokens_per_step=64))
    final = trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()

    assert sorted(p.name for p in (run_dir / "gradients").iterdir()) == [
        "step-2.safetensors",
        "step-3.safetensors",
    ]
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())}
    params = dict(named_leaves(final.state.model))
    dumps = {}
    for step in (2, 3):
        dumps[step] = load_file(run_dir / "gradients" / f"step-{step}.safetensors")
        assert set(dumps[step]) == {n for n, p in params.items() if p is not None}
        assert norm(dumps[step]) == pytest.approx(records[step]["optim/grad_norm"], rel=1e-5)
    assert not np.allclose(dumps[2]["token_embeddings/weight"], dumps[3]["token_embeddings/weight"])
    up = dumps[3]["blocks/stacked/mlp/up/weight"]
    assert up.shape == params["blocks/stacked/mlp/up/weight"].array.shape == (2, 128, 32)

    (only,) = (run_dir / "mlp").iterdir()
    assert only.name == "step-3.safetensors"
    chosen = load_file(only)
    assert sorted(chosen) == [
        "blocks/stacked/mlp/down/bias",
        "blocks/stacked/mlp/down/weight",
        "blocks/stacked/mlp/up/bias",
        "blocks/stacked/mlp/up/weight",
    ]
    assert all(np.array_equal(chosen[k], dumps[3][k]) for k in chosen)
    with safe_open(only, "np") as f:
        metadata = f.metadata()
    assert metadata["step"] == "3"
    assert json.loads(metadata["axes"])["blocks/stacked/mlp/up/weight"] == [
        "layers",
        "mlp",
        "embed",
    ]

    nothing = DumpGradientsHook(steps=[1], include=["decoder/*"], run_dir=run_dir)
    with pytest.raises(
        ConfigError, match=r"\(dump_gradients\): include \['decoder/\*'\] matches no"
    ):
        nothing.on_train_begin(final)
    with pytest.raises(ValueError, match=r"\(dump_gradients\): steps must list at least one"):
        DumpGradientsHook(run_dir=run_dir)


@pytest.mark.slow
def test_two_processes_write_the_whole_gradient(tmp_path, processes_support):
    worker = Path(__file__).with_name("dump_gradients_worker.py")
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1",
    }

    def scenario(processes) -> list[dict]:
        port = free_port("")
        run_dir = processes.directory / "run"
        for i in range(2):
            args = [sys.executable, str(worker), str(i), "2", str(port), str(run_dir)]
            processes.start(f"worker{i}", args, env=env)
        outputs = processes.wait(timeout=240)
        return [json.loads(outputs[f"worker{i}"].strip().splitlines()[-1]) for i in range(2)]

    results = processes_support.run_scenario(tmp_path, scenario)
    first = results[0]
    assert first["sharded"], "the embedding should be split over the two processes (FSDP)"
    assert results[1]["grad_norm"] == first["grad_norm"]
    dump = load_file(Path(first["run_dir"]) / "gradients" / "step-2.safetensors")
    assert dump["token_embeddings/weight"].shape == (48, 32)  # whole, not one process's half
    assert norm(dump) == pytest.approx(first["grad_norm"], rel=1e-5)
    # the memory hook in the same run: every process logs the largest RSS of both, and each one's
    memory = first["memory"]
    assert memory == results[1]["memory"]
    rss = [memory[f"memory/process_{i}/host_rss_bytes"] for i in range(2)]
    assert memory["memory/host_rss_bytes"] == max(rss) and min(rss) > 1e6
    # and trainer.log_dir: each process's log in a file of its own
    logs = Path(first["run_dir"]) / "logs"
    paths = sorted(logs.iterdir())
    assert len(paths) == 2
    for i, path in enumerate(paths):
        assert path.name.endswith(f".process-{i}.log")
        assert f"worker {i} of 2 here" in path.read_text()
