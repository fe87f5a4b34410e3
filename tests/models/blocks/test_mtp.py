"""Multi-token prediction (``model.mtp_depth``, DeepSeek-V3): its losses fall under the real
train step and are logged as ``mtp/loss_<d>``; they are trained (their gradient reaches the
modules) but left out of the loss's value, which equals the model without them (1e-6); the
model with MTP exports exactly as the model without it (no MTP tensors) and has its logits; depth d's
inputs and targets are the tokens d and d + 1 ahead; bad weights are refused."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

from loomax.config import ConfigError
from loomax.hf import export_hf, read_hf
from loomax.lm import lm_loss
from loomax.models.blocks.mtp import shifted
from loomax.models.loss import next_token_loss_and_metrics
from loomax.train.state import TrainerState
from loomax.train.step import make_train_step, trainable_params

VOCAB, SEQ, STEPS = 64, 32, 10
PATTERN = np.tile([3, 1, 4, 1, 5, 9, 2, 6, 7], 4)[:SEQ]
BATCH = jnp.asarray(np.stack([PATTERN, np.roll(PATTERN, 2)]))
KEY = jax.random.PRNGKey(0)


@pytest.fixture(scope="module")
def config(families):
    """The tiny DeepSeek-V3 with 2 MTP depths; its experts' grouped matmul ``ragged_dot``
    (CPU's ``blocked`` loops over row tiles, dozens of while loops more in the train step to
    compile; the two are held equal in tests/models/moe/test_grouped_matmul.py)."""
    tiny = families.tiny_config("deepseek_v3", seq_len=SEQ, mtp_depth=2)
    return dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, matmul="ragged_dot"))


@pytest.fixture(scope="module")
def run(config):
    """``(first model, trained model, metrics of each step)`` of STEPS Adam steps."""
    model = config.build(VOCAB, key=KEY)
    optimizer = optax.adam(1e-2)
    state = TrainerState(
        jnp.zeros((), jnp.int32), model, optimizer.init(trainable_params(model)), KEY
    )
    step = jax.jit(make_train_step(lm_loss(block_size=16), optimizer, mp=jmp.get_policy("f32")))
    history = []
    for _ in range(STEPS):
        state, metrics = step(state, BATCH)
        history.append({k: float(v) for k, v in metrics.items() if np.ndim(v) == 0})
    return model, state.model, history


def test_the_mtp_losses_fall_and_are_logged_under_mtp(run):
    _, _, history = run
    for d in (1, 2):
        losses = [m[f"mtp/loss_{d}"] for m in history]
        assert losses[-1] < 0.7 * losses[0], (d, losses)
    assert not any(k.startswith("train/mtp") for k in history[0])


def test_trained_but_left_out_of_the_loss_value(config, run):
    model, trained, history = run
    without = dataclasses.replace(model, mtp=None, config=dataclasses.replace(config, mtp_depth=0))
    tokens = hax.named(BATCH, ("batch", "position"))

    def loss(m):
        (total, count), _ = next_token_loss_and_metrics(m, tokens, block_size=16)
        return total / count

    plain = jax.jit(loss)(without)
    # the train step's loss at the first model, with MTP: its side loss adds term - term (0);
    # the two programs may round the rest differently
    assert history[0]["train/loss"] == pytest.approx(float(plain), rel=1e-6)
    assert {"mtp/loss_1", "mtp/loss_2"} <= set(history[0])
    for before, after in zip(model.mtp.depths, trained.mtp.depths, strict=True):
        # the side loss's gradient reaches every depth: plain Adam moves a parameter by
        # exactly 0 at every step its gradient is 0
        moved = after.proj.weight.array - before.proj.weight.array
        assert float(jnp.abs(moved).max()) > 0


def test_exported_as_the_model_without_mtp(config, run, tmp_path):
    """The export of a model with MTP is the export of the same model without it (tensors
    and config.json): the family's own HF tests (tests/hf/test_transformers.py, transformers'
    logits to 1e-5 and greedy tokens) then cover it."""
    _, model, _ = run
    without = dataclasses.replace(model, mtp=None, config=dataclasses.replace(config, mtp_depth=0))
    export_hf(model, tmp_path / "mtp")
    export_hf(without, tmp_path / "plain")
    (c1, t1), (c2, t2) = read_hf(tmp_path / "mtp"), read_hf(tmp_path / "plain")
    assert c1 == c2 and c1["num_nextn_predict_layers"] == 0
    assert t1.keys() == t2.keys()
    for name in t1:
        np.testing.assert_array_equal(t1[name], t2[name], err_msg=name)
    logits = eqx.filter_jit(lambda m: m.logits(hax.named(PATTERN, "position")).array)
    np.testing.assert_array_equal(logits(model), logits(without))  # jitted: not op by op


def test_depth_inputs_and_targets_are_the_tokens_ahead():
    tokens = hax.named(jnp.arange(10).reshape(2, 5), ("batch", "position"))
    ahead, valid = shifted(tokens, 2)
    np.testing.assert_array_equal(ahead.array[0, :3], [2, 3, 4])
    np.testing.assert_array_equal(valid.rearrange(("batch", "position")).array[1], [1, 1, 1, 0, 0])


def test_weights_must_match_the_depth(config):
    assert config.mtp_weights == pytest.approx((0.15, 0.15))
    with pytest.raises(ConfigError, match="model.mtp_loss_weights"):
        dataclasses.replace(config, mtp_loss_weights=(0.1,))
    assert eqx.is_array(config.build(VOCAB, key=KEY).mtp.depths[1].proj.weight.array)


def test_the_depths_routing_bias_moves_with_their_load(config, run):
    """Aux-loss-free balancing reaches the MTP depths' MoE blocks: each step moves each
    depth's bias by +-rate per expert (from that depth's own load), as the main stack's."""
    first, trained, _ = run
    rate = config.moe.bias_update_rate
    assert rate > 0
    for before, after in zip(first.mtp.depths, trained.mtp.depths, strict=True):
        moved = np.asarray(after.block.mlp.bias.value.array - before.block.mlp.bias.value.array)
        assert np.abs(moved).max() >= rate * 0.999
        np.testing.assert_allclose(moved / rate, np.round(moved / rate), atol=1e-3)
        assert np.abs(moved).max() <= STEPS * rate * 1.001
