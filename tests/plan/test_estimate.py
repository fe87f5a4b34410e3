"""The step estimate's range (plan/estimate.py) and the collectives it reads from a compiled
program (plan/collectives.py): one efficiency for every op, a MoE load-imbalance term, a
communication term overlapped as the schedule says, the assumptions named."""

from __future__ import annotations

import json

import pytest

from loomax.plan.collectives import sent_bytes, traffic
from loomax.plan.estimate import EFFICIENCY, Inputs, estimate
from loomax.plan.flops import KernelCall
from loomax.plan.ideal import kernel_seconds


def test_kernels_and_xla_ops_take_one_efficiency():
    """A Pallas kernel's ideal time is its FLOPs at peak (not at an extra 65% of it, as
    before), and the range divides XLA's part and the kernels' alike."""
    kernel = KernelCall("splash_mha_fwd", flops=1e15, bytes=1e9)
    assert kernel_seconds(kernel, peak=1e15, bandwidth=1e12) == 1.0
    memory = KernelCall("splash_mha_fwd", flops=1e9, bytes=2e12)
    assert kernel_seconds(memory, peak=1e15, bandwidth=1e12) == 2.0
    eff = EFFICIENCY["tpu"]
    found = estimate(Inputs(compute_s=3.0, kernel_s=1.0, platform="tpu"))
    assert found.step_s == pytest.approx(
        {"best": 3.0 / eff.best, "expected": 3.0 / eff.expected, "worst": 3.0 / eff.worst}
    )
    assert found.kernel_s == pytest.approx(1.0 / eff.expected)  # the same share as before
    assert eff.best >= eff.expected > eff.worst > 0


def test_the_range_overlaps_communication_as_the_schedule_says():
    """Best: every transfer hidden behind compute; expected: the asynchronous part hidden,
    the rest added; worst: all of it added."""
    eff = EFFICIENCY["gpu"]
    inputs = Inputs(compute_s=1.0, comm_serial_s=0.5, comm_overlapped_s=0.25, platform="gpu")
    found = estimate(inputs).step_s
    assert found["best"] == pytest.approx(max(1.0 / eff.best, 0.75))
    assert found["expected"] == pytest.approx(1.0 / eff.expected + 0.5)
    assert found["worst"] == pytest.approx(1.0 / eff.worst + 0.75)
    heavy = estimate(Inputs(compute_s=0.1, comm_serial_s=2.0, platform="gpu")).step_s
    assert heavy["best"] == 2.0  # communication bound even when hidden


def test_the_busiest_device_sets_the_moe_layers_time():
    """A grouped-matmul kernel counted for the mean routed rows (a quarter of its buffer)
    waits for the busiest device: ``saved_rows`` without a measurement, a measured
    ``load_max`` where given; past the kept rows, every layer's recompute branch counts."""
    eff = EFFICIENCY["tpu"]
    common = {"compute_s": 2.0, "routed_s": [(1.0, 0.25)], "fallback_s": 0.3, "platform": "tpu"}
    kept = estimate(Inputs(saved_rows=1.5, **common))
    assert kept.step_s["best"] == pytest.approx(2.0)
    assert kept.step_s["expected"] == pytest.approx((2.0 + 0.5) / eff.expected)
    assert kept.step_s["worst"] == pytest.approx((2.0 + 0.5 + 0.3) / eff.worst)
    measured = estimate(Inputs(saved_rows=1.5, load_max=1.2, **common))
    assert measured.step_s["expected"] == pytest.approx((2.0 + 0.2) / eff.expected)
    assert measured.step_s["worst"] == kept.step_s["worst"]
    over = estimate(Inputs(saved_rows=1.5, load_max=2.0, **common))  # past the kept rows
    assert over.step_s["expected"] == pytest.approx((2.0 + 1.0 + 0.3) / eff.expected)
    dropless = estimate(Inputs(**common))  # neither: the worst is the whole buffer
    assert dropless.step_s["worst"] == pytest.approx((2.0 + 3.0) / eff.worst)
    text = " ".join(kept.assumptions)
    assert "MoE load" in text and "saved_rows 1.5" in text and "recompute branch" in text
    assert "load_max 1.2 (measured)" in " ".join(measured.assumptions)


def test_the_assumptions_are_named():
    found = estimate(Inputs(compute_s=1.0, platform="gpu", base="roofline"))
    compute, comm, left = found.assumptions
    assert compute.startswith("compute: every op alike (XLA's and Pallas kernels)")
    assert "48%" in compute and "25%" in compute and "H200" in compute
    assert comm.startswith("communication: none counted")
    assert left.startswith("not modelled:")


HLO = """HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%cond (p: (s32[], f32[1024])) -> pred[] {
  %p = (s32[], f32[1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]) parameter(0)
  %v = f32[1024] get-tuple-element(%p), index=1
  %k = f32[1024] custom-call(%v), custom_call_target="tpu_custom_call", backend_config={"body":"a kernel's
}}, metadata={op_name="its config holds a newline"}
  %ag = bf16[8,256]{1,0} all-gather(%w), channel_id=1, replica_groups=mesh['data'=4,'model'=2] {'data'}, dimensions={0}
  %ars = f32[1024] all-reduce-start(%v), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
  %f = f32[1024] fusion(%v), kind=kLoop, calls=%add
  %ard = f32[1024] all-reduce-done(%ars)
  ROOT %t = (s32[], f32[1024]) tuple(%i, %ard)
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024] parameter(0)
  %rs = f32[128]{0} reduce-scatter(%a), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %cps = (f32[1024], f32[1024], u32[], u32[]) collective-permute-start(%a), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[1024] collective-permute-done(%cps)
  %rows = bf16[64,128]{1,0} parameter(1)
  %ra2a = bf16[256,128]{1,0} ragged-all-to-all(%rows, %buf, %o, %s, %oo, %rs), channel_id=5, replica_groups=[1,4]<=[4]
  %w = (s32[], f32[1024]) while(%t0), condition=%cond, body=%body
  ROOT %r = f32[1024] get-tuple-element(%w), index=1
}
"""


def test_collectives_are_read_from_the_compiled_program_with_their_loops():
    """Bytes a device sends, per collective kind, a loop's body once per iteration (the
    condition's ``i < 6``), an asynchronous start overlapped only where compute is scheduled
    before its done. A kernel's config spanning lines (``}}, ...`` at a line's start) does not
    end the computation."""
    found = traffic(HLO, devices=8)
    kinds = {c.kind: c for c in found.collectives}
    assert kinds["all-gather"].group == 4 and kinds["all-gather"].times == 6
    assert kinds["all-gather"].bytes == 8 * 256 * 2 * 3 / 4
    assert kinds["all-reduce"].group == 4 and kinds["all-reduce"].overlapped
    assert kinds["all-reduce"].bytes == 2 * 4096 * 3 / 4
    assert kinds["reduce-scatter"].bytes == 512 * 7 and kinds["reduce-scatter"].times == 1
    assert not kinds["collective-permute"].overlapped  # nothing between its start and done
    assert kinds["collective-permute"].bytes == 4096
    # a ragged all-to-all sends its input's rows (64 of them), not its receive buffer (256);
    # the way back, the buffer's rows into 64 (the smaller of the two)
    assert kinds["ragged-all-to-all"].bytes == 64 * 128 * 2 * 3 / 4
    assert found.bytes == pytest.approx(6 * (3072 + 6144) + 512 * 7 + 4096 + 12288)
    assert found.overlapped_bytes == 6 * 6144
    assert found.unknown_loops == 0
    known = HLO.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"3"}}')
    assert traffic(known, devices=8).bytes == pytest.approx(3 * (3072 + 6144) + 3584 + 4096 + 12288)


def test_a_ring_schedule_sends_these_bytes():
    assert sent_bytes("all-reduce", 100.0, 4) == 150.0
    assert sent_bytes("all-gather", 100.0, 4) == 75.0
    assert sent_bytes("reduce-scatter", 25.0, 4) == 75.0
    assert sent_bytes("all-to-all", 100.0, 4) == 75.0
    assert sent_bytes("all-gather", 100.0, 1) == 0.0
    assert sent_bytes("collective-permute", 100.0, 2) == 100.0


def test_the_h200_calibration_is_recorded_with_its_ratio(repo_root):
    """bench/calibrate_roofline.py's record: the measured tokens/s (from the H200 runs'
    JSON) over the roofline's for the same configs, each ratio the GPU efficiency it sets,
    and docs/planning.md states them, labelled as measurement and estimate."""
    record = json.loads(
        (repo_root / "bench" / "results" / "roofline_calibration_h200.json").read_text()
    )
    ratios = {}
    for case in record["cases"]:
        run = json.loads((repo_root / case["measured_from"]).read_text())[case["measured_key"]]
        assert case["measured_tokens_per_second"] == run["tokens_per_second"]
        ratio = case["measured_tokens_per_second"] / case["roofline_tokens_per_second"]
        assert case["ratio"] == pytest.approx(ratio, abs=5e-4)
        ratios[case["model"]] = ratio
    eff = EFFICIENCY["gpu"]
    assert eff.expected == pytest.approx(ratios["llama-1b"], abs=0.01)
    assert eff.worst == pytest.approx(ratios["gpt2-124m"], abs=0.01)
    docs = (repo_root / "docs" / "planning.md").read_text()
    assert "### Calibration against the H200" in docs
    for ratio in ratios.values():
        assert f"{ratio:.3f}" in docs


def test_the_plan_shows_each_candidates_range():
    """`loomax plan`'s table has a `range` column (worst-best estimated MFU) next to the
    expected end, and the overlay's header states the range with the expected MFU."""
    from loomax.plan.candidates import Candidate
    from loomax.plan.compile import CompileResult
    from loomax.plan.report import overlay_yaml, plan_table
    from loomax.plan.search import Ranked

    result = CompileResult("v5p:2x2x1", 4, {"data": 4}, "TPU v5p", 95 * 2**30, fits=True)
    result.est_best_s, result.est_step_s, result.est_worst_s = 1.0, 1.2, 1.6
    result.est_best_mfu, result.est_mfu, result.est_worst_mfu = 0.6, 0.5, 0.375
    ranked = [Ranked(Candidate("fsdp 4x1 (the run's)", {"trainer.fsdp_axis": "embed"}), result)]
    table = plan_table(ranked)
    assert "range" in table.splitlines()[0] and "38%-60%" in table
    header = overlay_yaml(ranked[0], "run.yaml", "v5p:2x2x1", 1)
    assert "estimated MFU 50.0% (range 38%-60%" in header
