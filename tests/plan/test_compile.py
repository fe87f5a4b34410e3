"""`loomax compile` through the trainer's own code path: tiny GPT-2 and Llama on v5e/v5p."""

from __future__ import annotations

import math

import jax
import pytest

pytestmark = pytest.mark.usefixtures("libtpu", "quick_compiles")  # conftest.py: why quick

from loomax.lm.config import TrainLmConfig  # noqa: E402

SPLASH = (
    "--model.seq_len", "256", "--model.num_heads", "4",
    "--model.splash_block_q", "128", "--model.splash_block_kv", "128",
)  # fmt: skip
"""Llama on v5p:2x2x1 is compiled once, with these flags (splash blocks of 128 over 256
positions), for the hand count, the splash count and the range below."""
EXTRA = {("llama", "v5p:2x2x1"): SPLASH}


def hand_state_bytes(config: TrainLmConfig, fsdp_ways: int) -> int:
    """Params + Adam's two moments (f32), each split `fsdp_ways` along `embed`; no scalars."""
    shapes = jax.eval_shape(lambda: config.model.build(512, key=jax.random.PRNGKey(0)))
    total = 0
    for leaf in jax.tree.leaves(shapes, is_leaf=lambda x: hasattr(x, "axes")):
        if not hasattr(leaf, "axes"):
            continue
        sizes = [a.size // fsdp_ways if a.name == "embed" else a.size for a in leaf.axes]
        total += math.prod(sizes) * 4  # f32 parameters
    return 3 * total  # parameter, mu, nu


@pytest.mark.parametrize(
    "model,topology",
    [
        ("gpt2", "v5e:2x2"),
        ("llama", "v5p:2x2x1"),
        pytest.param("gpt2", "v5p:2x2x1", marks=pytest.mark.slow),
        pytest.param("llama", "v5e:2x2", marks=pytest.mark.slow),
    ],
)
def test_tiny_models_compile_and_state_bytes_match_hand_count(model, topology, plan_runs):
    extra = EXTRA.get((model, topology), ())
    config = plan_runs.tiny(model, *extra)
    result = plan_runs.compiled(model, topology, *extra)
    assert result.devices == 4 and result.mesh == {
        "replica": 1,
        "data": 4,
        "expert": 1,
        "context": 1,
        "model": 1,
        "stage": 1,
    }
    assert result.fits is True and result.error is None
    assert 0 < result.total_bytes < result.hbm_bytes
    assert result.temp_bytes > 0
    # FSDP: every parameter has an embed axis (64, split 4 ways); scalars (step, count, key) add bytes
    scalars = result.state_bytes - hand_state_bytes(config, 4)
    assert 0 <= scalars <= 64, scalars
    assert result.model_flops > 0 and result.step_flops >= result.model_flops
    assert result.est_step_s > 0 and 0 < result.est_mfu <= 1


def test_fsdp_over_four_chips_holds_a_quarter_of_the_replicated_state(plan_runs):
    fsdp = plan_runs.compiled("llama", "v5e:2x2")
    replicated = plan_runs.compiled("llama", "v5e:2x2", "--trainer.fsdp_axis", "null")
    assert replicated.state_bytes - hand_state_bytes(plan_runs.tiny("llama"), 1) <= 64
    assert abs(replicated.state_bytes - 4 * fsdp.state_bytes) <= 4 * 64


def test_splash_kernels_are_counted_from_their_math_not_as_free(plan_runs):
    """auto attention on TPU is the splash kernel; XLA's cost model sees its calls as
    almost free, so the estimate adds each call's lower bound, and the FLOPs count the
    visible causal pairs: forward (4 per pair and head dimension, twice: once more when the
    backward recomputes the layer), dq (6) and dkv (8)."""
    seq, layers, batch, heads, head = 256, 2, 8, 4, 16
    result = plan_runs.compiled("llama", "v5p:2x2x1", *SPLASH)
    assert (str(seq), str(heads)) == SPLASH[1:4:2]
    pairs = seq * (seq + 1) / 2
    assert result.kernel_flops == layers * batch * heads * head * pairs * (2 * 4 + 6 + 8)
    assert 0 < result.est_kernel_s < result.est_step_s
    assert any(
        "Pallas kernels XLA does not cost" in n
        and "splash_mha_fwd" in n
        and "at the same efficiency as XLA's ops" in n
        for n in result.notes
    )


def test_compile_reports_a_range_with_its_assumptions(plan_runs):
    """FSDP over 4 chips: the estimate is a range, best <= expected <= worst, over the same
    compute at one efficiency per end, and the parameters' all-gathers and the gradients'
    reductions of the compiled program are its communication term, named in the report."""
    from loomax.plan.report import compile_text

    result = plan_runs.compiled("llama", "v5p:2x2x1", *SPLASH)  # the program above
    assert 0 < result.est_best_s <= result.est_step_s <= result.est_worst_s
    assert result.est_best_mfu >= result.est_mfu >= result.est_worst_mfu > 0
    assert result.comm_bytes > 0 and result.comm_s > 0  # FSDP gathers every layer's weights
    kinds = " ".join(result.assumptions)
    assert "compute: every op alike (XLA's and Pallas kernels)" in kinds
    assert "communication:" in kinds and "all-gather" in kinds and "GB/s a device" in kinds
    text = compile_text(result)
    assert "estimated step time (best / expected / worst): " in text
    assert "estimated MFU: " in text and "assumptions:\n  - compute: " in text


def test_context_parallel_ring_compiles_splash_per_chunk_pair(plan_runs):
    """attn_backend splash with context 2: the ring runs splash per chunk pair (its private dq/dkv
    kernels lowered by Mosaic for v5p), and the count is the unsplit splash count above:
    the ring's pairs are exactly the causal ones, the all-visible pairs charged whole."""
    seq, layers, batch, heads, head = 512, 2, 8, 4, 16
    result = plan_runs.compiled(
        "llama", "v5p:2x2x1", "--model.seq_len", str(seq), "--model.num_heads", str(heads),
        "--model.splash_block_q", "128", "--model.splash_block_kv", "128",
        "--trainer.mesh.context", "2", "--model.attn_backend", "splash",
    )  # fmt: skip
    assert result.mesh["context"] == 2 and result.fits is True and result.error is None
    pairs = seq * (seq + 1) / 2
    assert result.kernel_flops == layers * batch * heads * head * pairs * (2 * 4 + 6 + 8)
    assert any("splash_mha_dkv" in n and "splash_mha_fwd" in n for n in result.notes)
