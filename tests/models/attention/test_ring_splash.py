"""The ring with splash per chunk pair (``models/attention/ring_splash.py``, Pallas interpret mode on 8
fake CPU devices, a fresh process) against the blockwise ring; which kernel the ring picks;
the pin on splash's private backward entry points; the plan's count of the splash ring."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from loomax.config import ConfigError
from loomax.models.attention import splash_pair
from loomax.models.attention.ring_attention import ring_kernel
from loomax.models.attention.splash import splash_kernel_flops

WORKER = Path(__file__).with_name("ring_splash_run.py")
TOLERANCE = 1e-5
"""Float32: the two rings sum the same terms in other orders (values up to ~7)."""


@pytest.fixture(scope="module")
def splash_runs(json_worker):
    return json_worker(WORKER)


@pytest.mark.parametrize("case", ["data2_context4", "context2_model4"])
def test_splash_ring_equals_blockwise_ring(splash_runs, case):
    """Seq 1024, head 128, blocks 128: data 2 x context 4 (chunks of one block), context 2 x
    model 4 (chunks of two blocks, heads split); documents of ~100 positions, so some
    queries see no key of a whole chunk pair. Outputs and dQ/dK/dV of a weighted sum."""
    run = splash_runs[case]
    assert run["largest"] > 1.0
    for name, error in run["errors"].items():
        assert error < TOLERANCE, (name, run["errors"])


@pytest.mark.parametrize("case", ["data2_context4", "context2_model4"])
def test_splash_ring_count_is_the_causal_work(splash_runs, case):
    """The plan's count of the splash ring (forward + backward) is splash's kernels only, and
    exactly the causal pairs of the whole sequence: the diagonals causal, every other chunk
    pair whole (``FULL_SCOPE``). Charging those causally would fall short."""
    run = splash_runs[case]
    assert run["kernels"] == [
        "splash_mha_dkv_segmented_no_residuals",
        "splash_mha_dq_segmented_no_residuals",
        "splash_mha_fwd_segmented_residuals",
    ]
    assert run["dot_flops"] == 0  # no blockwise kernel left in the splash ring
    assert run["kernel_flops"] == pytest.approx(run["causal_flops"], rel=1e-12)


@pytest.mark.parametrize("case", ["data2_context4", "context2_model4"])
def test_saving_ring_residuals_spares_the_splash_forward_rerun(splash_runs, case):
    """Under layer remat the backward runs the splash ring's forward kernels again (4 of the
    18 passes a pair: fwd 4, dq 6, dkv 8), unless the policy saves ``ring_residuals``."""
    run = splash_runs[case]
    assert run["remat_saved_flops"] == pytest.approx(run["kernel_flops"], rel=1e-12)
    assert run["remat_flops"] == pytest.approx(run["kernel_flops"] * 22 / 18, rel=1e-12)


def test_full_pair_flops_count_every_pair():
    shape = (2, 4, 256, 128)
    causal = splash_kernel_flops("splash_mha_fwd_residuals", shape, 256)
    full = splash_kernel_flops("splash_mha_fwd_residuals", shape, 256, causal=False)
    assert full == 4 * 2 * 4 * 256 * 256 * 128
    assert causal == 4 * 2 * 4 * (256 * 257 / 2) * 128


def test_ring_kernel_choice():
    """splash where asked for (any platform: interpret mode off TPU); blockwise under auto on
    every platform (the splash ring is compiled for TPUs, not yet run on one), and always
    for all_gather."""
    assert ring_kernel("splash", "ring", 256, (128, 128)) == "splash"
    assert ring_kernel("auto", "ring", 256, (128, 128)) == "blockwise"
    assert ring_kernel("blockwise", "ring", 256, (128, 128)) == "blockwise"
    assert ring_kernel("splash", "all_gather", 256, (128, 128)) == "blockwise"
    with pytest.raises(ConfigError, match=r"ring's chunk pairs \(192 positions.*multiple of"):
        ring_kernel("splash", "ring", 192, (128, 128))


def test_private_backward_entry_points_are_pinned(monkeypatch):
    """The kernels this JAX has take the parameters the pair passes; another signature is a
    clear error naming both JAX versions."""
    sk = splash_pair.private_kernels()

    def changed(q, k, v, segment_ids, logsumexp, do, di, *, bq, bkv):
        raise AssertionError("not to be called")

    monkeypatch.setattr(sk, "_splash_attention_bwd_dkv", changed)
    with pytest.raises(RuntimeError, match=rf"_splash_attention_bwd_dkv.*JAX {jax.__version__}"):
        splash_pair.private_kernels()
    monkeypatch.delattr(sk, "_splash_attention_bwd_dkv")
    with pytest.raises(RuntimeError, match="no such function"):
        splash_pair.private_kernels()
