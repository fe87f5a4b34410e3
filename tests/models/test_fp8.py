"""FP8 matmuls: the current-scaling arithmetic (e4m3 operands, e5m2 gradients), the
compiled form (FP8 converts around the dot), which layers convert, the refusal on devices
without FP8, and training with it: the loss follows float32, a resume is exact."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import equinox as eqx
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models import LlamaConfig, MixtralConfig, MoeConfig
from loomax.models.fp8 import (
    E4M3,
    E5M2,
    Fp8DotGeneral,
    check_fp8,
    dequantize,
    fp8_dot_general,
    quantize,
    to_fp8,
)

DN = (((1,), (0,)), ((), ()))  # x [m, k] @ w [k, n]
X = jax.random.normal(jax.random.PRNGKey(0), (32, 48)) * 3.0
W = jax.random.normal(jax.random.PRNGKey(1), (48, 24)) * 0.05


def test_quantize_scales_the_absolute_maximum_to_the_format_maximum():
    q, scale = quantize(X, E4M3)
    assert q.dtype == E4M3 and scale == pytest.approx(float(jnp.abs(X).max()) / 448.0)
    assert float(jnp.abs(q.astype(jnp.float32)).max()) == 448.0
    back = dequantize(q, scale, jnp.float32)
    big = jnp.abs(X) > 0.05 * jnp.abs(X).max()  # e4m3 normals: 3 mantissa bits
    rel = jnp.abs(back - X)[big] / jnp.abs(X)[big]
    assert float(rel.max()) <= 2.0**-4
    zeros, one = quantize(jnp.zeros((3, 3)), E5M2)
    assert float(one) == 1.0 and not jnp.any(zeros.astype(jnp.float32))


def test_forward_is_the_dot_of_the_dequantised_operands():
    out = fp8_dot_general(X, W, DN, jnp.dtype(jnp.float32))
    (qx, sx), (qw, sw) = quantize(X, E4M3), quantize(W, E4M3)
    want = dequantize(qx, sx, jnp.float32) @ dequantize(qw, sw, jnp.float32)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    exact = X @ W
    assert float(jnp.abs(out - exact).max()) < 0.08 * float(jnp.abs(exact).max())


def test_gradients_use_an_e5m2_cotangent_against_the_saved_e4m3_operands():
    g = jax.random.normal(jax.random.PRNGKey(2), (32, 24))
    _, vjp = jax.vjp(lambda a, b: fp8_dot_general(a, b, DN, jnp.dtype(jnp.float32)), X, W)
    dx, dw = vjp(g)
    (qx, sx), (qw, sw), (qg, sg) = quantize(X, E4M3), quantize(W, E4M3), quantize(g, E5M2)
    xd, wd, gd = (dequantize(q, s, jnp.float32) for q, s in ((qx, sx), (qw, sw), (qg, sg)))
    np.testing.assert_allclose(dx, gd @ wd.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, xd.T @ gd, rtol=1e-5, atol=1e-5)
    exact_dw = X.T @ g
    assert float(jnp.abs(dw - exact_dw).max()) < 0.2 * float(jnp.abs(exact_dw).max())


def test_the_compiled_step_multiplies_fp8_operands():
    def loss(x, w):
        return jnp.sum(fp8_dot_general(x, w, DN, jnp.dtype(jnp.bfloat16)).astype(jnp.float32))

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(X, W))
    assert "float8_e4m3fn" in text and "float8_e5m2" in text
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(X, W).as_text().lower()
    assert "f8e4m3fn" in hlo and "f8e5m2" in hlo


def _linears(tree):
    is_linear = lambda x: isinstance(x, hnn.Linear)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_linear)[0]
    return {jax.tree_util.keystr(p): type(x.dot_general).__name__ for p, x in flat if is_linear(x)}


def test_only_the_blocks_linear_layers_convert():
    llama = LlamaConfig(
        seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    kinds = _linears(to_fp8(llama.build(37, key=jax.random.PRNGKey(0))))
    assert kinds[".lm_head"] == "DefaultDotGeneralOp"
    blocks = {k: v for k, v in kinds.items() if k.startswith(".blocks")}
    assert len(blocks) == 7 and set(blocks.values()) == {"Fp8DotGeneral"}
    moe = MixtralConfig(
        seq_len=16, hidden_dim=16, intermediate_dim=16, num_layers=1, num_heads=2,
        moe=MoeConfig(num_experts=2, num_experts_per_tok=1),
    )  # fmt: skip
    kinds = _linears(to_fp8(moe.build(37, key=jax.random.PRNGKey(0))))
    assert kinds[".blocks.stacked.mlp.router"] == "DefaultDotGeneralOp"
    assert kinds[".blocks.stacked.attn.q_proj"] == "Fp8DotGeneral"


def test_fp8_on_is_refused_without_fp8_matmuls():
    with pytest.raises(ConfigError, match="model.fp8: on needs FP8 matmuls.*cpu"):
        check_fp8("on")
    ampere = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100")
    with pytest.raises(ConfigError, match="compute capability 8.0"):
        check_fp8("on", [ampere])
    hopper = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100")
    check_fp8("on", [hopper])
    check_fp8("emulate")  # any device
    with pytest.raises(ConfigError, match="model.fp8 must be one of"):
        LlamaConfig(fp8="yes")
    assert LlamaConfig(fp8=True).fp8 == "on" and LlamaConfig(fp8="False").fp8 == "off"


TINY = LlamaConfig(
    seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
)
VOCAB = 61


def _train(config, run_dir, steps):
    from loomax.checkpoint import CheckpointerConfig, KeepPolicy
    from loomax.data import BatchLoader, TokenWindows
    from loomax.lm import lm_loss
    from loomax.optim import AdamConfig
    from loomax.tracking import NoopTrackerConfig
    from loomax.train import Trainer, TrainerConfig

    rng = np.random.default_rng(0)
    tokens = np.tile(rng.integers(0, VOCAB, 8 * config.seq_len, dtype=np.int32), 6)
    settings = TrainerConfig(
        num_train_steps=steps, train_batch_size=8, run_dir=str(run_dir),
        tracker=NoopTrackerConfig(), progress_bar=False,
        checkpointer=CheckpointerConfig(keep=[KeepPolicy(every=4)]),
    )  # fmt: skip
    opt = AdamConfig(learning_rate=1e-2, warmup=1)
    trainer = Trainer(settings, opt.build(8), lm_loss(block_size=None))
    losses = {}
    trainer.add_hook(lambda info: losses.__setitem__(info.step, info.loss))
    init = lambda key: config.for_training(config.build(VOCAB, key=key))  # noqa: E731
    state = trainer.initial_state(init)
    batches = BatchLoader(TokenWindows(tokens, config.seq_len), 8, seed=1)
    final = trainer.train(state, batches.iter_from(int(state.step))).state
    return losses, final


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    return _train(dataclasses.replace(TINY, fp8="emulate"), tmp_path_factory.mktemp("fp8"), 8)


def test_fp8_training_follows_float32(fp8_run, tmp_path):
    losses, _ = fp8_run
    reference, _ = _train(TINY, tmp_path, 8)
    assert losses[8] < losses[1] - 1.5  # it learns, within 10% of float32 at every step
    # (measured: 4.727 -> 2.886 vs 4.743 -> 2.683; hidden 32 is coarse for per-tensor scales)
    for step in range(1, 9):
        assert abs(losses[step] - reference[step]) < 0.1 * reference[step], step


def test_an_fp8_run_resumes_exactly(fp8_run, tmp_path):
    config = dataclasses.replace(TINY, fp8="emulate")
    _train(config, tmp_path, 4)  # a checkpoint at step 4
    losses, resumed = _train(config, tmp_path, 8)
    full_losses, full = fp8_run
    assert {s: losses[s] for s in range(5, 9)} == {s: full_losses[s] for s in range(5, 9)}
    same = jax.tree.map(
        lambda a, b: bool(jnp.array_equal(a, b)),
        eqx.filter(resumed.model, eqx.is_array),
        eqx.filter(full.model, eqx.is_array),
    )
    assert all(jax.tree.leaves(same))
    assert isinstance(resumed.model.blocks.stacked.mlp.gate_proj.dot_general, Fp8DotGeneral)
