"""Profiler: jax.profiler traces of the steps its schedule picks land in the run directory."""

from __future__ import annotations

import logging

import pytest

from loomax.hooks import ProfilerHook
from loomax.hooks.profiler import kernel_category, summarize_trace


def test_trace_of_steps_is_written(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=5)
    hook = ProfilerHook(directory=str(tmp_path / "run" / "profile"), wait=1, active=2)
    active = {}
    trainer.add_hook(hook)
    trainer.add_hook(lambda info: active.update({info.step: hook.active}), priority=-1)
    trainer.train(tiny.init(trainer), tiny.batches())
    assert active == {1: True, 2: True, 3: False, 4: False, 5: False}
    assert hook.traced == [(2, 3)] and list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
    # a Perfetto trace too, which summarize_trace reads: XLA's ops of the traced steps
    summary = summarize_trace(tmp_path / "run" / "profile", top=5)
    assert summary["busy_ms"] > 0 and summary["events"] > 0
    assert 0 < len(summary["top"]) <= 5
    assert summary["top"][0]["ms"] >= summary["top"][-1]["ms"]
    assert sum(summary["by_category"].values()) == pytest.approx(summary["busy_ms"], rel=1e-3)


def python_calls_traced(directory, name: str) -> int:
    """How many of the Perfetto trace's events under ``directory`` are Python calls of ``name``."""
    import gzip
    import json

    (trace,) = directory.rglob("*.trace.json.gz")
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    return sum(name in event.get("name", "") for event in events)


@pytest.mark.parametrize("python_tracer", [False, True])
def test_python_calls_are_traced_only_when_asked(tiny, tmp_path, python_tracer):
    """JAX's Python tracer is off by default (it made one traced step of the hook contract
    test stop 12 s late); ``python_tracer: true`` records every Python call."""
    trainer = tiny.trainer(tmp_path, steps=3)
    directory = tmp_path / "profile"
    trainer.add_hook(
        ProfilerHook(directory=str(directory), wait=1, active=1, python_tracer=python_tracer)
    )
    trainer.train(tiny.init(trainer), tiny.batches())
    calls = python_calls_traced(directory, "training_steps")  # the loop's generator, in Python
    assert (calls > 0) == python_tracer


def test_a_repeating_schedule_with_memory_profiles_on_the_chosen_processes(tiny, tmp_path, caplog):
    trainer = tiny.trainer(tmp_path, steps=7)
    hook = ProfilerHook(
        wait=1, warmup=1, active=1, repeat=2, memory_profile=True, run_dir=trainer.run_dir
    )
    elsewhere = ProfilerHook(processes=[1], wait=0, run_dir=tmp_path / "other")
    trainer.add_hook(hook)
    trainer.add_hook(elsewhere)
    with caplog.at_level(logging.INFO, logger="loomax.hooks.profiler"):
        trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    assert hook.traced == [(2, 3), (5, 6)]  # cycles of 3 steps: wait 1, warmup 1, active 1
    profile = trainer.run_dir / "profile"
    assert len(list(profile.rglob("*.xplane.pb"))) == 2
    assert sorted(str(p.relative_to(profile)) for p in profile.rglob("*.prof")) == [
        "steps-2-3/memory-step-3.process-0.prof",
        "steps-5-6/memory-step-6.process-0.prof",
    ]
    assert "ui.perfetto.dev" in caplog.text and ".trace.json.gz in" in caplog.text
    assert not elsewhere.enabled and not elsewhere.traced and not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match=r"\(profiler\): repeat must be >= 0"):
        ProfilerHook(repeat=-1, directory="x")


def test_summary_needs_a_trace(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace.json.gz"):
        summarize_trace(tmp_path)


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
        ("gemm_fusion_dot_general_12", "matmul"),
        ("memcpy128", "copy"),
        ("ncclDevKernel_AllReduce_Sum_bf16", "collective"),
        ("input_add_reduce_fusion", "other"),
    ],
)
def test_kernel_categories(name, category):  # names seen in an H200 trace of GPT-2
    assert kernel_category(name) == category


def test_the_trace_directory_defaults_to_the_run_dir_and_is_required(tmp_path):
    assert ProfilerHook(run_dir=tmp_path).directory == tmp_path / "profile"
    with pytest.raises(ValueError, match="ProfilerHook needs a directory or a run_dir"):
        ProfilerHook()
