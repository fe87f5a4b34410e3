"""Step programs: a real run saves its step's jaxpr and optimized HLO as artifacts."""

from __future__ import annotations

import pytest

from loomax.hooks import StepProgramsHook


def test_jaxpr_and_hlo_of_the_step_are_saved_after_the_first_step(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=3)
    hook = StepProgramsHook(
        trace_step=trainer.trace_step, write_artifact=trainer.write_artifact, mesh=trainer.mesh
    )
    trainer.add_hook(hook)
    trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    artifacts = trainer.run_dir / "artifacts"
    assert hook.written == ["train_step.jaxpr.txt", "train_step.hlo.txt"]
    jaxpr = (artifacts / "train_step.jaxpr.txt").read_text()
    hlo = (artifacts / "train_step.hlo.txt").read_text()
    assert "{ lambda" in jaxpr and "dot_general" in jaxpr
    assert hlo.startswith("HloModule") and "ENTRY" in hlo and "fusion" in hlo
    with pytest.raises(ValueError, match=r"\(step_programs\): set log_jaxprs or log_xla_hlo"):
        StepProgramsHook.Config(log_jaxprs=False, log_xla_hlo=False)
