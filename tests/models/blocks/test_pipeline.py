"""Pipeline parallelism (``trainer.mesh.stage``): a tiny Llama trained on 8 CPU devices as
stage 4 x data 2 under each executed schedule (GPipe, circular, 1F1B, interleaved 1F1B,
zero-bubble) equals 1 device's losses and gradient norms, as does a tiny mixture of experts
on stage 2 x expert 2 x data 2 (GPipe, 1F1B, interleaved 1F1B, zero-bubble), and its
checkpoint resumes at stage 2 (one subprocess). That 1F1B holds about ``p`` microbatches
whatever ``m`` is checked on its buffers in ``test_pipeline_explicit.py``; the compiled
temporaries of GPipe against 1F1B are measured by ``bench/pipeline_memory.py``
(docs/pipeline.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.mesh import MeshConfig
from loomax.models.blocks.pipeline import bubble, pipeline_plan
from loomax.pipeline_schedules import formula, table
from loomax.stages import PipelineConfig
from loomax.train import TrainerConfig

WORKER = Path(__file__).with_name("pipeline_run.py")


@pytest.fixture(scope="module")
def runs(json_worker):
    return json_worker(WORKER)


SCHEDULES = ["gpipe", "interleaved", "1f1b", "interleaved_1f1b", "zero_bubble"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_staged_losses_equal_one_device(runs, schedule):
    assert len(runs["single"]["losses"]) == 5
    np.testing.assert_allclose(runs[schedule]["losses"], runs["single"]["losses"], rtol=1e-5)
    single, staged = runs["single"]["grad_norms"], runs[schedule]["grad_norms"]
    np.testing.assert_allclose(staged, single, rtol=1e-5)  # Adam alone would hide a scale


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "slots"), [("gpipe", 11), ("interleaved", 19)])
def test_the_compiled_loop_idles_the_bubble_of_its_table(runs, schedule, slots):
    # stage 4, 8 microbatches (x 2 chunks interleaved): v m + p - 1 slots, v m of them busy
    assert slots in runs[schedule]["loop_trip_counts"]
    busy = 8 * (2 if schedule == "interleaved" else 1)
    v = busy // 8
    assert (slots - busy) / slots == pytest.approx(bubble(4, 8, v))
    assert table("circular", 4, 8, v).bubble == pytest.approx(bubble(4, 8, v))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "v", "actions"),
    [("1f1b", 1, 2), ("interleaved_1f1b", 2, 2), ("zero_bubble", 1, 3)],
)
def test_the_explicit_loop_runs_its_table_and_idles_its_bubble(runs, schedule, v, actions):
    # one slot per F, B (and W): a stage is busy actions x v x m of the table's slots
    t = table(schedule, 4, 8, v, backward_slots=1)
    assert len(t.slots) in runs[schedule]["loop_trip_counts"]
    busy = actions * v * 8
    assert (len(t.slots) - busy) / len(t.slots) == pytest.approx(formula(schedule, 4, 8, v))


@pytest.mark.slow
def test_the_counted_flops_carry_the_bubble(runs):
    # loomax plan's count of the stack's gradient: every slot computes, idle ones on zeros,
    # so staged / unstaged = (v m + p - 1) / (v m): 1F1B/GPipe's 3/11 bubble, 3/19 at v = 2
    flops = runs["stack_flops"]
    assert flops["gpipe"] / flops["single"] == pytest.approx(11 / 8)
    assert flops["interleaved"] / flops["single"] == pytest.approx(19 / 16)
    assert 1 - flops["single"] / flops["gpipe"] == pytest.approx(table("1f1b", 4, 8).bubble)


@pytest.mark.slow
def test_layers_and_their_optimizer_state_rest_on_their_stage(runs):
    # 8 layers over 4 stages: 2 per device; embed (32) split over data 2 (FSDP within a stage)
    assert runs["gpipe"]["mlp_up_shard_shape"] == [2, 64, 16]
    assert runs["single"]["mlp_up_shard_shape"] == [8, 64, 32]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_a_mixture_of_experts_on_stage_2_x_expert_2_x_data_2_equals_one_device(runs, schedule):
    # gpipe: the router statistics go round the ring with each microbatch; 1f1b & co: each
    # chunk's backward also differentiates its layers' share of the z-loss (without it
    # zero_bubble's gradient norm differs by 1.2e-4); the load-balance weight is 0: a product
    # of batch shares, it is per microbatch when staged (as with gradient accumulation); the
    # experts' all-to-all runs inside the stage (a shard_map manual over the axes but stage)
    moe = runs["moe"]
    assert len(moe["single"]["losses"]) == 5
    np.testing.assert_allclose(moe[schedule]["losses"], moe["single"]["losses"], rtol=1e-5)
    np.testing.assert_allclose(moe[schedule]["grad_norms"], moe["single"]["grad_norms"], rtol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_of_4_stages_resumes_on_2_with_bitwise_equal_losses(runs):
    # the stage-4 GPipe run's step-1 checkpoint, resumed at stage 2 x data 2: steps 2 to 5
    # bit for bit as the stage-4 run went on. Step 2's loss and gradients (their norm) come
    # from the restored parameters; steps 3-5 from updates with the restored Adam state.
    # The head after the loop takes whole microbatches per stage, summed in one pairwise
    # tree; the embedding is looked up whole per stage; the global norm (clipping) is
    # summed per layer, then in order
    resumed, continued = runs["resume"], runs["gpipe"]
    assert resumed["start"] == 1
    assert len(resumed["losses"]) == 4
    assert resumed["losses"] == continued["losses"][1:]  # exactly
    # the norm of the restored state's gradients bit for bit; later ones may differ in the
    # last bit (step 4's by one ulp: a sum over axes XLA splits its own way), and the
    # losses after them stay equal
    assert resumed["grad_norms"][0] == continued["grad_norms"][1]
    np.testing.assert_allclose(resumed["grad_norms"], continued["grad_norms"][1:], rtol=1e-6)
    assert resumed["mlp_up_shard_shape"] == [4, 64, 16]  # 8 layers over 2 stages


def test_stacked_layers_map_to_the_stage_axis():
    mappings = TrainerConfig(mesh=MeshConfig(data=2, stage=4)).axis_mappings()
    assert mappings.parameter["layers"] == "stage" and mappings.optimizer["layers"] == "stage"
    assert "layers" not in mappings.compute
    assert mappings.compute["batch"] == ("replica", "data", "expert", "stage")  # head, loss
    assert "layers" not in TrainerConfig().axis_mappings().parameter  # no stages: unchanged


def test_pipeline_plan_names_what_does_not_divide():
    assert pipeline_plan(8, 16, 4, PipelineConfig()) == (8, 1)
    with pytest.raises(ConfigError, match="must divide the model's 6 layers"):
        pipeline_plan(6, 16, 4, PipelineConfig())
    with pytest.raises(ConfigError, match="microbatches \\(3\\) must divide"):
        pipeline_plan(8, 16, 4, PipelineConfig(microbatches=3))
    interleaved = PipelineConfig(schedule="interleaved", virtual_stages=2, microbatches=2)
    with pytest.raises(ConfigError, match="at least trainer.mesh.stage"):
        pipeline_plan(8, 16, 4, interleaved)


def test_pipeline_config_names_bad_schedules():
    PipelineConfig(schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="must be one of"):
        PipelineConfig(schedule="looped")
    with pytest.raises(ValueError, match="needs trainer.pipeline.schedule: interleaved"):
        PipelineConfig(schedule="1f1b", virtual_stages=2)
    config = PipelineConfig(schedule="interleaved_1f1b", virtual_stages=2, microbatches=6)
    with pytest.raises(ConfigError, match="multiple of trainer.mesh.stage \\(4\\)"):
        pipeline_plan(8, 24, 4, config)


def test_loop_bubble_follows_its_formula():
    assert bubble(4, 8) == pytest.approx(3 / 11)
    assert bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble(1, 8) == 0


@pytest.mark.slow
def test_activation_statistics_and_max_logits_on_stages_equal_one_device(runs):
    # GPipe on stage 2 x data 2, 4 microbatches: each chunk fills its layers' rows of the
    # statistics that go round the ring with each microbatch; the whole batch's come from
    # the microbatches' (mean of means, std and RMS from mean squares, max of maxima). The
    # near-zero fraction is the one approximate figure (each microbatch's own threshold)
    stats = runs["stack_stats"]
    single, staged = stats["single"], stats["gpipe"]
    assert set(staged) == set(single)
    assert "activations/layer_3/residual/std" in single and "layers_from_0" in single
    assert np.asarray(single["layers_from_0"]).shape == (4, 4)  # (layers, heads)
    for key, value in single.items():
        if key.endswith("/near_zero"):  # 4096 values, 1024 a microbatch: within 3 values
            np.testing.assert_allclose(staged[key], value, atol=3 / 4096, err_msg=key)
        else:
            np.testing.assert_allclose(staged[key], value, rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.slow
def test_explicit_schedules_refuse_activation_statistics_naming_the_schedule(runs):
    assert runs["stats_1f1b"].startswith("trainer.pipeline.schedule '1f1b': not with activation")
