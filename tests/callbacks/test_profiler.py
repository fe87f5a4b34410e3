"""Profiler: a jax.profiler trace of the chosen steps lands in the run directory."""

from __future__ import annotations

from loomax.callbacks import ProfilerHook


def test_trace_of_steps_is_written(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=5)
    hook = ProfilerHook(directory=str(tmp_path / "run" / "profile"), start=2, num_steps=2)
    active = {}
    trainer.add_hook(hook)
    trainer.add_hook(lambda info: active.update({info.step: hook.active}), priority=-1)
    trainer.train(tiny.init(trainer), tiny.batches())
    assert active == {1: True, 2: True, 3: False, 4: False, 5: False}
    assert hook.done and list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
