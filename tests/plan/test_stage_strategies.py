"""The pipeline strategies ``loomax plan`` tries: per stage count GPipe and the loss-in-loop
schedules (1F1B with more microbatches, interleaved 1F1B, zero-bubble), each with its
bubble, ranked with the other candidates by estimated step time (pure Python: the compiles
are stood in for)."""

from __future__ import annotations

import types

import pytest

from loomax.config import parse_config
from loomax.lm.config import TrainLmConfig
from loomax.plan.candidates import OFFLOAD_KEYS, run_default
from loomax.plan.stage_loop import schedule_bubble
from loomax.plan.stage_strategies import schedule_plans, stage_strategies


def test_deep_models_try_each_schedule_on_each_stage_count():
    assert stage_strategies(128, 1, 32, 512) == []  # shallower than STAGES_FROM_LAYERS
    labels = [c.label for c in stage_strategies(128, 1, 80, 512)]
    assert labels[:4] == [
        "fsdp pp2 64x2 gpipe m4",
        "fsdp pp2 64x2 1f1b m8",
        "fsdp pp2 64x2 interleaved_1f1b v2 m8",
        "fsdp pp2 64x2 zero_bubble m8",
    ]
    assert len(labels) == 12 and "fsdp pp8 16x8 zero_bubble m32" in labels
    # 256 rows over 16 data devices: 32 microbatches of 8 rows do not split, 16 do
    fewer = [c.label for c in stage_strategies(128, 1, 80, 256)]
    assert "fsdp pp8 16x8 1f1b m16" in fewer and "fsdp pp8 16x8 gpipe m16" in fewer
    assert [c.label for c in stage_strategies(16, 1, 60, 64, explicit=False)] == [
        "fsdp pp2 8x2 gpipe m4",
        "fsdp pp4 4x4 gpipe m8",
    ]  # two stacks or MTP (DeepSeek-V3): GPipe only
    assert stage_strategies(16, 1, 80, 16) == []  # no microbatch splits over the data devices
    one_f = next(c for c in stage_strategies(128, 1, 80, 512) if c.label.endswith("1f1b m16"))
    applied = one_f.apply(parse_config(TrainLmConfig, None, []))
    assert applied.trainer.mesh.resolve(128)["stage"] == 4
    assert applied.trainer.pipeline.schedule == "1f1b"
    assert applied.trainer.pipeline.microbatches == 16
    flags = ["--trainer.mesh.stage", "4", "--trainer.pipeline.schedule", "interleaved"]
    staged_run = parse_config(
        TrainLmConfig, None, [*flags, "--trainer.pipeline.virtual_stages", "2"]
    )
    assert run_default(staged_run, 8).label == "fsdp pp4 2x1 (the run's)"
    for candidate in stage_strategies(128, 1, 80, 512)[4:8]:  # from 2 chunks a device, and to
        pipeline = candidate.apply(staged_run).trainer.pipeline
        assert pipeline.virtual_stages == (2 if "interleaved" in candidate.label else 1)


def test_the_loss_in_loop_schedules_run_more_microbatches_for_a_smaller_bubble():
    """Llama-3-70B's 80 layers at 512 rows over stage 4 x data 32: GPipe holds its 8
    microbatches' inputs; the 1F1B family holds about 4 and runs 16."""
    plans = {p.label: p for p in schedule_plans(4, 80, 512, 32)}
    assert list(plans) == ["gpipe m8", "1f1b m16", "interleaved_1f1b v2 m16", "zero_bubble m16"]
    assert plans["gpipe m8"].bubble == pytest.approx(3 / 11)
    assert plans["1f1b m16"].bubble == pytest.approx(3 / 19)
    assert plans["interleaved_1f1b v2 m16"].bubble == pytest.approx(3 / 35)
    assert plans["zero_bubble m16"].bubble == pytest.approx(3 / 51)
    assert [p.held for p in plans.values()] == [8, 4, 4, 4]
    # 256 rows: 16 microbatches of 16 rows cannot split over 32 devices, so 8
    assert [p.label for p in schedule_plans(4, 80, 256, 32)][1] == "1f1b m8"
    # 60 layers do not cut into 2 x 8 chunks: no interleaved 1F1B on 8 stages
    assert "interleaved_1f1b" not in str(schedule_plans(8, 60, 512, 16))
    assert "interleaved_1f1b v2 m32" in [p.label for p in schedule_plans(8, 80, 512, 16)]


def test_the_plan_ranks_the_schedules_and_shows_their_bubbles(monkeypatch):
    """A search over an 80-layer model on 16 chips: every schedule is compiled (stood in
    for here), ranked by estimated step time with the others, and its table row shows the
    formula's bubble and the count's."""
    from loomax.plan import search as search_module
    from loomax.plan.compile import CompileResult
    from loomax.plan.report import plan_table
    from loomax.plan.search import Ranked, search

    def fake_compile_all(config, topology, candidates, **_):
        out = []
        for c in candidates:
            result = CompileResult("v5p", 16, {}, "TPU v5p", 100, total_bytes=90, fits=True)
            pipeline = c.overrides.get("trainer.pipeline.schedule")
            result.est_step_s = 2.0
            if pipeline:
                stages = c.overrides["trainer.mesh"]["stage"]
                m = c.overrides["trainer.pipeline.microbatches"]
                v = c.overrides["trainer.pipeline.virtual_stages"]
                formula = schedule_bubble(pipeline, stages, m, v)
                counted = formula if pipeline == "gpipe" else 2 * formula
                result.pipeline = {"schedule": pipeline, "formula": formula, "counted": counted}
                result.est_step_s = 1.0 / (1.0 - counted)
            out.append(Ranked(c, result))
        return out

    monkeypatch.setattr(search_module, "compile_all", fake_compile_all)
    flags = ["--model.num_layers", "80", "--trainer.train_batch_size", "64"]
    config = parse_config(TrainLmConfig, None, flags)
    chips = types.SimpleNamespace(num_devices=16, num_slices=1, platform="tpu")
    ranked = search(config, chips, max_candidates=40, progress=False)
    staged = [r for r in ranked if r.result.pipeline]
    assert {r.result.pipeline["schedule"] for r in staged} == {
        "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"
    }  # fmt: skip
    onboard = [r for r in ranked if not any(r.candidate.overrides.get(k) for k in OFFLOAD_KEYS)]
    steps = [r.result.est_step_s for r in onboard]  # offloaded state is ranked after (search)
    assert steps == sorted(steps) and len(onboard) > 20
    assert ranked[0].candidate.label == "fsdp pp2 8x2 zero_bubble m8"  # 2 x 1/25 idle
    table = plan_table(ranked).splitlines()
    row = next(line for line in table if "pp4 4x4 1f1b m16" in line)
    assert row.endswith("15.8%/31.6%")  # formula 3/19, the stand-in count twice that
    assert next(line for line in table if "fsdp 16x1 " in line).endswith(" -")
    assert table[-1].startswith("bubble f/c (estimates, not measurements)")
