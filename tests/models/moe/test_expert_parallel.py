"""Expert parallelism on 8 CPU devices (a subprocess: the device count is fixed when JAX
starts): the MoE layer with its experts split over ``trainer.mesh.expert`` gives the
single-device output and gradients, through both forms of the token exchange, with FSDP and
tensor parallelism; 5 Mixtral steps on expert 4 x data 2 give the single-device losses.
A run's experts must split over the axis; MoE FLOPs count the active experts only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loomax.config import ConfigError, parse_config
from loomax.lm import TrainLmConfig
from loomax.models import LlamaConfig, MixtralConfig, MoeConfig

WORKER = Path(__file__).with_name("expert_parallel_run.py")


@pytest.fixture(scope="module")
def runs(json_worker):
    return json_worker(WORKER)


@pytest.mark.slow
def test_layer_equals_one_device_with_experts_split(runs):
    layer = runs["layer"]
    assert len(layer) == 4
    for case, diff in layer.items():
        # experts over `expert`, embed over `data` (FSDP), mlp over `model` (TP)
        assert diff["gate_spec"] == "P('expert', 'data', 'model')", case
        assert diff["out"] <= 1e-6 * diff["out_scale"], case
        assert diff["grads"] <= 1e-6, case  # relative to each gradient's largest entry
        assert diff["dropped"][0] == diff["dropped"][1], case
        # the padded form exchanges tokens by all_to_all (there, back, and both in the
        # backward pass); the ragged one by ragged_all_to_all (emulated on the CPU)
        assert (diff["all_to_alls"] == 4) == ("padded" in case), case
    assert layer["expert2_data2_model2 capacity=0.5 k=2 padded auto"]["dropped"][0] > 0
    # the real ragged form (GPU/TPU) lowers with JAX's checks of its operands: one exchange
    # each way whatever the local experts (2 a device here), their transposes backward: 4
    # (XLA:CPU cannot compile it)
    assert runs["ragged_ops"] == 4
    # kept rows = each device's mean routed rows: some of the 8 devices hold more (they
    # recompute in the backward), others fewer; the router metric says how many
    assert 0 < runs["recomputed_fraction"] < 1


@pytest.mark.slow
def test_ragged_form_equals_the_padded_form_on_the_same_inputs(runs):
    # the ragged exchange's offsets and sizes (its collective emulated from all_gather, NaN
    # where the sizes a receiver expects disagree with what arrives) against the padded
    # all_to_all path XLA:CPU runs: output and every gradient bitwise equal
    for buffer, forms in runs["forms"].items():
        assert forms["arrays"] > 4, buffer
        assert forms["max_diff"] == 0.0, buffer
        assert forms["dropped"][0] == forms["dropped"][1], buffer


@pytest.mark.slow
def test_a_bounded_receive_buffer_drops_what_does_not_fit(runs):
    # half the mean routed rows: a receiver takes at most its share of each sender's rows,
    # the rest dropped and counted
    forms = runs["forms"]
    assert forms["None"]["dropped"] == [0.0, 0.0]
    assert forms["0.5"]["dropped"][0] > 0


def test_receive_buffer_rows_per_sender():
    moe = MoeConfig(num_experts=8, num_experts_per_tok=2)
    assert moe.sender_rows(tokens=64, ways=4) == 64 * 2  # dropless: T x min(k, E / ways)
    bounded = MoeConfig(num_experts=8, num_experts_per_tok=2, receive_buffer=1.25)
    assert bounded.sender_rows(tokens=64, ways=4) == 40  # 1.25 x 128 routed rows / 4
    # a buffer above the dropless bound is the dropless bound: the same program
    roomy = MoeConfig(num_experts=8, num_experts_per_tok=2, receive_buffer=8.0)
    assert roomy.sender_rows(tokens=64, ways=4) == moe.sender_rows(tokens=64, ways=4)
    with pytest.raises(ConfigError, match="model.moe.receive_buffer"):
        MoeConfig(receive_buffer=0)


@pytest.mark.slow
def test_training_on_expert4_data2_gives_the_losses_of_one_device(runs):
    one, split = runs["one"], runs["expert4_data2"]
    assert split["mesh"] == {
        "replica": 1,
        "data": 2,
        "expert": 4,
        "context": 1,
        "model": 1,
        "stage": 1,
    }
    assert split["gate_spec"] == "P(None, 'expert', 'data', 'model')"  # (layers, experts, ...)
    assert len(one["losses"]) == 5
    np.testing.assert_allclose(split["losses"], one["losses"], rtol=1e-5)
    # keeping the experts' projections of the mean routed rows (the rest recomputed)
    np.testing.assert_allclose(runs["expert4_data2_kept"]["losses"], one["losses"], rtol=1e-5)


def test_experts_must_split_over_the_expert_axis():
    args = ["--model.type", "mixtral", "--model.moe.num_experts", "6"]
    with pytest.raises(
        ConfigError, match=r"num_experts \(6\) must be a multiple of trainer.mesh.expert \(4\)"
    ):
        parse_config(TrainLmConfig, None, [*args, "--trainer.mesh.expert", "4"])
    assert parse_config(TrainLmConfig, None, [*args, "--trainer.mesh.expert", "2"])


def test_flops_count_the_active_experts_and_the_router_only():
    """What MFU and ``loomax plan`` divide by: k experts' MLPs and the router per token, not
    all experts (a dense Llama of MLP width k x expert width, plus the router's matmul)."""
    dims = dict(seq_len=64, hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2)
    dense = LlamaConfig(**dims, intermediate_dim=2 * 48)
    few, many = (
        MixtralConfig(
            **dims, intermediate_dim=48, moe=MoeConfig(num_experts=e, num_experts_per_tok=2)
        )
        for e in (8, 64)
    )
    router = 3 * 2 * 32  # layers x 2 x hidden_dim, per expert
    assert few.flops_per_token(100) == dense.flops_per_token(100) + 8 * router
    assert many.flops_per_token(100) - few.flops_per_token(100) == 56 * router
