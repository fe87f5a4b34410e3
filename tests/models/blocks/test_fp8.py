"""FP8 matmuls: the current-scaling arithmetic (e4m3 operands, e5m2 gradients), the
compiled form (every dot of the gradient takes FP8 operands; three FP8 GEMMs per linear in a
program compiled for an H100), which layers convert, the refusal on devices without FP8, and
training with it: the loss follows float32, a resume is exact."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import equinox as eqx
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models import LlamaConfig, MixtralConfig, MoeConfig
from loomax.models.blocks.fp8 import (
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


@jax.jit  # the quantisations as one program (op by op, each op compiled on its own)
def _round_trip(x):
    q, scale = quantize(x, E4M3)
    return q, scale, dequantize(q, scale, jnp.float32), quantize(jnp.zeros((3, 3)), E5M2)


def test_quantize_scales_the_absolute_maximum_to_the_format_maximum():
    q, scale, back, (zeros, one) = _round_trip(X)
    x = np.asarray(X)
    assert q.dtype == E4M3 and scale == pytest.approx(float(np.abs(x).max()) / 448.0)
    assert float(np.abs(np.asarray(q).astype(np.float32)).max()) == 448.0
    big = np.abs(x) > 0.05 * np.abs(x).max()  # e4m3 normals: 3 mantissa bits
    rel = np.abs(np.asarray(back) - x)[big] / np.abs(x)[big]
    assert float(rel.max()) <= 2.0**-4
    assert float(one) == 1.0 and not np.any(np.asarray(zeros).astype(np.float32))


@jax.jit  # the references as one program (apart from the FP8 dots they check)
def _dequantised(x, w, g):
    """x and w through e4m3 and g through e5m2 and back, and the exact ``x @ w``, ``x.T @ g``."""
    (qx, sx), (qw, sw), (qg, sg) = quantize(x, E4M3), quantize(w, E4M3), quantize(g, E5M2)
    deq = (dequantize(q, s, jnp.float32) for q, s in ((qx, sx), (qw, sw), (qg, sg)))
    return *deq, x @ w, x.T @ g


def test_forward_is_the_dot_of_the_dequantised_operands():
    out = np.asarray(
        jax.jit(fp8_dot_general, static_argnums=(2, 3))(X, W, DN, jnp.dtype(jnp.float32))
    )
    xd, wd, _, exact, _ = (np.asarray(a) for a in _dequantised(X, W, jnp.zeros((32, 24))))
    np.testing.assert_allclose(out, xd @ wd, rtol=1e-6, atol=1e-6)
    assert float(np.abs(out - exact).max()) < 0.08 * float(np.abs(exact).max())


def test_gradients_use_an_e5m2_cotangent_against_the_saved_e4m3_operands():
    g = jax.random.normal(jax.random.PRNGKey(2), (32, 24))

    @jax.jit  # one program (op by op, each op compiled on its own)
    def gradients(x, w, g):
        _, vjp = jax.vjp(lambda a, b: fp8_dot_general(a, b, DN, jnp.dtype(jnp.float32)), x, w)
        return vjp(g)

    dx, dw = (np.asarray(a) for a in gradients(X, W, g))
    xd, wd, gd, _, exact_dw = (np.asarray(a) for a in _dequantised(X, W, g))
    np.testing.assert_allclose(dx, gd @ wd.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, xd.T @ gd, rtol=1e-5, atol=1e-5)
    assert float(np.abs(dw - exact_dw).max()) < 0.2 * float(np.abs(exact_dw).max())


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


def _abstract(build):
    """The model ``build()`` makes, its arrays as ``ShapeDtypeStruct``s (nothing computed:
    which layers convert, and a traced gradient, need only the structure)."""
    return eqx.filter_eval_shape(build)


def test_only_the_blocks_linear_layers_convert():
    llama = LlamaConfig(
        seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    kinds = _linears(_abstract(lambda: to_fp8(llama.build(37, key=jax.random.PRNGKey(0)))))
    assert kinds[".lm_head"] == "DefaultDotGeneralOp"
    blocks = {k: v for k, v in kinds.items() if k.startswith(".blocks")}
    assert len(blocks) == 7 and set(blocks.values()) == {"Fp8DotGeneral"}
    moe = MixtralConfig(
        seq_len=16, hidden_dim=16, intermediate_dim=16, num_layers=1, num_heads=2,
        moe=MoeConfig(num_experts=2, num_experts_per_tok=1),
    )  # fmt: skip
    kinds = _linears(_abstract(lambda: to_fp8(moe.build(37, key=jax.random.PRNGKey(0)))))
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
    # (measured: 4.727 -> 2.878 vs 4.743 -> 2.683; hidden 32 is coarse for per-tensor scales)
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


FP8_TYPES = (jnp.dtype(E4M3), jnp.dtype(E5M2))


def _dots(jaxpr) -> list:
    """Every ``dot_general`` equation of ``jaxpr`` and of the jaxprs inside it (custom VJPs,
    ``pjit``, scans, remat), as ``(lhs dtype, rhs dtype, preferred_element_type)``."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval.dtype for v in eqn.invars)
            found.append((lhs, rhs, eqn.params.get("preferred_element_type")))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr or a Jaxpr
                if hasattr(inner, "eqns"):
                    found += _dots(inner)
    return found


def test_every_dot_of_the_gradient_takes_fp8_operands():
    """Forward x·w (e4m3 × e4m3), dgrad dy·wᵀ and wgrad xᵀ·dy (e5m2 × e4m3): three dots, each
    of the FP8 arrays themselves, accumulating in float32 (no f32 × f32 dot of dequantised
    values, which no GPU runs as an FP8 GEMM)."""

    def loss(x, w, y):
        return jnp.sum(fp8_dot_general(x, w, DN, jnp.dtype(jnp.bfloat16)).astype(jnp.float32) * y)

    y = jax.random.normal(jax.random.PRNGKey(3), (32, 24))
    xb, wb = X.astype(jnp.bfloat16), W.astype(jnp.bfloat16)
    dots = _dots(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(xb, wb, y).jaxpr)
    e4, e5, f32 = jnp.dtype(E4M3), jnp.dtype(E5M2), jnp.dtype(jnp.float32)
    assert sorted(dots, key=str) == sorted([(e4, e4, f32), (e5, e4, f32), (e5, e4, f32)], key=str)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(xb, wb, y)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, dimension_numbers",
    [
        ((6, 32), (24, 32), (((1,), (1,)), ((), ()))),  # x · wᵀ
        ((2, 3, 16), (16, 4, 8), (((2,), (0,)), ((), ()))),  # a Linear to two axes
        ((4, 5, 16), (8, 4, 16), (((2,), (2,)), ((0,), (1,)))),  # batch axes
        ((16, 3, 8), (8, 2, 16), (((0, 2), (2, 0)), ((), ()))),  # two contracting, out of order
    ],
)
def test_the_fp8_gradients_of_any_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers):
    """dgrad and wgrad match the float32 gradient of the dequantised dot (JAX's own transpose)
    for any contraction, and the float32 gradient of the exact dot within FP8's error."""
    f32 = jnp.dtype(jnp.float32)
    deq = lambda p, q: jax.lax.dot_general(p, q, dimension_numbers)  # noqa: E731

    @jax.jit  # one program a case, not each op compiled on its own
    def gradients(key):
        k1, k2, k3 = jax.random.split(key, 3)
        a, b = jax.random.normal(k1, lhs_shape), jax.random.normal(k2, rhs_shape)
        out, vjp = jax.vjp(lambda p, q: fp8_dot_general(p, q, dimension_numbers, f32), a, b)
        g = jax.random.normal(k3, out.shape)
        (qa, sa), (qb, sb), (qg, sg) = quantize(a, E4M3), quantize(b, E4M3), quantize(g, E5M2)
        _, ref_vjp = jax.vjp(deq, dequantize(qa, sa, f32), dequantize(qb, sb, f32))
        return vjp(g), ref_vjp(dequantize(qg, sg, f32)), jax.vjp(deq, a, b)[1](g)

    (da, db), (want_a, want_b), exact_grads = gradients(jax.random.PRNGKey(4))
    np.testing.assert_allclose(da, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, want_b, rtol=1e-5, atol=1e-5)
    for got, exact in zip((da, db), exact_grads, strict=True):
        assert float(jnp.abs(got - exact).max()) < 0.15 * float(jnp.abs(exact).max())


SMALL = LlamaConfig(
    seq_len=32, hidden_dim=64, intermediate_dim=128, num_layers=1, num_heads=4,
    num_kv_heads=2, scan_layers=False, gradient_checkpointing=False,
)  # fmt: skip
"""No layer scan and no remat: each linear runs its three matmuls once a step. One block:
a block's linears are the program's every kind of linear (a second block repeats them, and
doubled the H100 compiles' GEMMs for no other check)."""
SMALL_LINEARS = SMALL.num_layers * 7  # q, k, v, o, gate, up, down in each block
SMALL_OTHER_GEMMS = 3 + 6 * SMALL.num_layers
"""The GEMMs that stay in the compute dtype: the LM head's three, attention's six per block."""


def _model_gradient(config):
    """The train step's gradient of ``config`` (the trainer's loss), and an abstract model."""
    from loomax.lm import lm_loss

    model = _abstract(lambda: config.for_training(config.build(VOCAB, key=jax.random.PRNGKey(0))))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    loss = lm_loss(block_size=None)

    def grad(params, tokens):
        total = lambda p: loss(eqx.combine(p, static), tokens)[0][0]  # noqa: E731
        return jax.grad(total)(params)

    tokens = jnp.zeros((2, config.seq_len), jnp.int32)
    return grad, params, tokens


def test_a_models_fp8_linears_take_fp8_operands_in_every_gradient_dot():
    """In the whole train-step gradient of a Llama with fp8, three dots per linear layer take
    FP8 operands (and nothing else changed): the other dots are the fp8-off model's."""
    grad, params, tokens = _model_gradient(dataclasses.replace(SMALL, fp8="emulate"))
    dots = _dots(jax.make_jaxpr(grad)(params, tokens).jaxpr)
    fp8 = [d for d in dots if d[0] in FP8_TYPES or d[1] in FP8_TYPES]
    assert all(d[0] in FP8_TYPES and d[1] in FP8_TYPES for d in fp8), fp8
    assert len(fp8) == 3 * SMALL_LINEARS
    e4, e5 = jnp.dtype(E4M3), jnp.dtype(E5M2)
    assert sum(d[:2] == (e4, e4) for d in fp8) == SMALL_LINEARS  # forward
    assert sum(d[:2] == (e5, e4) for d in fp8) == 2 * SMALL_LINEARS  # dgrad and wgrad
    grad_off, params_off, _ = _model_gradient(SMALL)
    plain = _dots(jax.make_jaxpr(grad_off)(params_off, tokens).jaxpr)
    assert len(dots) - len(fp8) == len(plain) - 3 * SMALL_LINEARS


CUDA_12_9 = "runtime_version { major: 12 minor: 9 patch: 0 }\n"
"""The CUDA runtime the program is for: without it XLA takes the toolkit for older than 12.0
and its GEMM rewriter makes no cuBLASLt FP8 call (it upcasts the FP8 operands to f16)."""
_INSTR = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = ([a-z0-9]+)\[", re.M)
_DOT = re.compile(r"\bdot\(%([^,\s]+), %([^)\s]+)\)")


def _fp8_gemms(hlo: str) -> tuple[int, int, int]:
    """``(cuBLASLt FP8 GEMMs, dots of two FP8 operands (Triton GEMM fusions), other GEMMs)``
    in an optimised GPU program's text (instruction names are unique in a module)."""
    types = dict(_INSTR.findall(hlo))
    cublas_f8 = hlo.count('custom_call_target="__cublas$lt$matmul$f8"')
    cublas = len(re.findall(r'custom_call_target="__cublas\$(?:lt\$)?(?:matmul|gemm)"', hlo))
    dots = [(types[a], types[b]) for a, b in _DOT.findall(hlo)]
    fp8 = sum(a.startswith("f8") and b.startswith("f8") for a, b in dots)
    return cublas_f8, fp8, cublas + len(dots) - fp8


def _gpu_program(fn, *args, triton_gemm: bool = True, dot_merger: bool = True) -> str:
    """``fn`` compiled for one H100 through JAX's CUDA plugin (no GPU: compile-only), with
    XLA's Triton GEMMs and its dot merger on (XLA's defaults) or off."""
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from loomax.plan.gpus import GPUS, check_cuda_plugin

    check_cuda_plugin()  # in the test extra (`gpu-plan`): fails, doesn't skip
    desc = topologies.get_topology_desc(
        platform="cuda", topology_name="", target_config=GPUS["h100"].target_config() + CUDA_12_9,
        topology="1x1x1",
    )  # fmt: skip
    on_gpu = SingleDeviceSharding(desc.devices[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_gpu), args)
    options = {} if dot_merger else {"xla_disable_hlo_passes": "dot-merger"}
    if not triton_gemm:
        options["xla_gpu_enable_triton_gemm"] = False
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # this host can't load it back
    try:
        return jax.jit(fn).lower(*abstract).compile(compiler_options=options).as_text()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)


@pytest.fixture(scope="module")
def fp8_step():
    return _model_gradient(dataclasses.replace(SMALL, fp8="on"))


@pytest.mark.parametrize("triton_gemm", [True, False], ids=["triton", "cublaslt"])
def test_the_compiled_h100_step_runs_three_fp8_gemms_per_linear(fp8_step, triton_gemm):
    """The train-step gradient of a Llama with fp8, compiled for an H100: each of its 7
    linear layers is three FP8 GEMMs (forward, dgrad, wgrad). XLA's default makes them Triton
    GEMM fusions of FP8 operands; with Triton GEMMs off, cuBLASLt FP8 calls. The other 9
    GEMMs (the LM head's three, attention's six per block) stay in the compute dtype. (XLA's
    dot merger is off here so that each matmul is its own GEMM; see the next test.)"""
    hlo = _gpu_program(*fp8_step, triton_gemm=triton_gemm, dot_merger=False)
    cublas_f8, triton_f8, other = _fp8_gemms(hlo)
    fp8 = 3 * SMALL_LINEARS
    expected = (0, fp8) if triton_gemm else (fp8, 0)
    assert (cublas_f8, triton_f8, other) == (*expected, SMALL_OTHER_GEMMS)


def test_xlas_default_h100_program_merges_fp8_gemms_and_keeps_them_fp8(fp8_step):
    """With XLA's defaults, q, k and v (one input) and gate and up (one input) merge into one
    forward and one weight-gradient GEMM each: 21 - 6 = 15 FP8 GEMMs (6 fewer a block), still
    all FP8, and the same 9 others. (The dequantise-then-dot form before compiled to no FP8
    GEMM at all, 45 GEMMs at two blocks: XLA folded the quantisation round trip away.)"""
    merged = 6 * SMALL.num_layers
    assert _fp8_gemms(_gpu_program(*fp8_step)) == (0, 3 * SMALL_LINEARS - merged, SMALL_OTHER_GEMMS)
