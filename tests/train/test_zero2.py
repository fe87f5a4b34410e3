"""ZeRO-2 (``trainer.shard_params: false``): parameters whole on every device, optimizer state
split over ``data``; against plain data parallel and FSDP on 8 CPU devices (a subprocess)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loomax.train import TrainerConfig

WORKER = Path(__file__).with_name("zero2_run.py")

# The tiny GPT-2 of sharded_run.py (vocab 64, 16 positions, embed 32, 2 layers, 4 heads of 8,
# mlp 128), by hand. Arrays with an `embed` axis (split 8 ways by FSDP/ZeRO-2):
#   token 64*32 + position 16*32 + per layer (ln_attn 2*32, qkv 3*4*8*32, out 32*32 + 32,
#   ln_mlp 2*32, up 128*32, down 32*128 + 32) * 2 layers + ln_final 2*32 = 27,584 floats;
# without one (kept whole): qkv bias 3*4*8 + up bias 128, per layer * 2 = 448 floats.
WITH_EMBED, WITHOUT = 27_584, 448
PARAMS = (WITH_EMBED + WITHOUT) * 4  # float32 bytes of the whole model
SPLIT = (WITH_EMBED // 8 + WITHOUT) * 4  # bytes of one device's part of them
COUNTS = 2 * 4  # Adam's step count and the LR schedule's, int32 scalars, on every device


@pytest.fixture(scope="module")
def runs(json_worker):
    return json_worker(WORKER)


@pytest.mark.slow
def test_per_device_state_memory_is_as_counted_by_hand(runs):
    assert runs["dp"]["memory"] == {"params": PARAMS, "opt_state": 2 * PARAMS + COUNTS}
    assert runs["zero2"]["memory"] == {"params": PARAMS, "opt_state": 2 * SPLIT + COUNTS}
    assert runs["fsdp"]["memory"] == {"params": SPLIT, "opt_state": 2 * SPLIT + COUNTS}


@pytest.mark.slow
def test_losses_equal_plain_data_parallel(runs):
    for name in ("zero2", "fsdp"):
        np.testing.assert_allclose(runs[name]["losses"], runs["dp"]["losses"], rtol=1e-6)
    assert len(runs["dp"]["losses"]) == 5


@pytest.mark.slow
def test_updated_parameters_are_gathered_back_to_every_device(runs):
    assert "all-gather" not in runs["dp"]["collective_bytes"]  # DP: gradients all-reduced only
    assert (
        runs["zero2"]["collective_bytes"]["all-gather"] > 0
    )  # ZeRO-2: each device updates its part


def test_zero2_keeps_parameters_whole_and_splits_optimizer_state():
    mappings = TrainerConfig(shard_params=False).axis_mappings()
    assert "embed" not in mappings.parameter and mappings.optimizer["embed"] == "data"
    assert mappings.zero2 and not TrainerConfig().axis_mappings().zero2


def test_loomax_plan_tries_zero2():
    from loomax.config import parse_config
    from loomax.lm.config import TrainLmConfig
    from loomax.plan.candidates import mesh_strategies, run_default

    by_label = {c.label: c for c in mesh_strategies(8)}
    config = by_label["zero2 8x1"].apply(parse_config(TrainLmConfig, None, []))
    assert config.trainer.shard_params is False and config.trainer.fsdp_axis == "embed"
    assert "zero2 1x8" not in by_label  # one data device: nothing to split
    own = parse_config(TrainLmConfig, None, ["--trainer.shard_params", "false"])
    assert run_default(own, 8).label.startswith("zero2 8x1")


@pytest.mark.slow
def test_tpu_program_reduce_scatters_the_gradients(libtpu):
    """Compiled for v5e:2x2 (libtpu on the CPU host): ZeRO-2's gradients go through XLA's
    all-reduce-scatter fusions (each chip gets the quarter it updates); data parallel's do not."""
    from loomax.config import parse_config
    from loomax.lm.config import TrainLmConfig
    from loomax.plan.build import built_step
    from loomax.plan.topology import get_topology

    args = [
        "--model.type", "gpt2", "--model.hidden_dim", "64", "--model.num_heads", "4",
        "--model.seq_len", "64", "--model.num_layers", "2", "--model.vocab_size", "512",
        "--trainer.train_batch_size", "8",
    ]  # fmt: skip
    devices = get_topology("v5e:2x2").devices

    def program(*extra: str) -> str:
        with built_step(parse_config(TrainLmConfig, None, [*args, *extra]), devices) as built:
            return built.trace().lower().compile().as_text()

    assert "calls=%all-reduce-scatter" in program("--trainer.shard_params", "false")
    assert "all-reduce-scatter" not in program("--trainer.fsdp_axis", "null")
