"""Multi-head latent attention: equal to transformers' ``DeepseekV3Attention`` (f32, 1e-5) with
and without the query bottleneck and with DeepSeek's YaRN; the same through the blocked
backends; decoding over the latent cache (up-projections absorbed) equals the full
recompute and greedy tokens match; the cache is <= 1/8 of Llama's per token at V3's shape;
context-parallel training equals one device; a split decode is refused."""

from __future__ import annotations

import itertools
from pathlib import Path

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models.attention import mla
from loomax.models.attention.mla import MlaAttention, MlaConfig
from loomax.models.attention.mla_cache import MlaCache, cache_bytes_per_token
from loomax.models.attention.rotary import DefaultRotary, RotaryConfig, YarnRotary
from loomax.models.config import KvCache
from loomax.models.decoding.stack import decode_layers
from loomax.models.families.llama import LlamaConfig

B, T = 2, 16
YARN = YarnRotary(
    theta=10000.0, factor=4.0, original_max_position_embeddings=8,
    beta_fast=32.0, beta_slow=1.0, mscale=0.7, mscale_all_dim=1.0,
)  # fmt: skip
TINY = dict(
    hidden_dim=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=6, rope=YARN,
)  # fmt: skip


def settings(backend="vanilla") -> LlamaConfig:
    return LlamaConfig(attn_backend=backend, flash_attention_block_size=8)


def tiny(q_lora_rank=None, backend="vanilla", seed=0, **overrides) -> MlaAttention:
    config = MlaConfig(**{**TINY, "q_lora_rank": q_lora_rank, **overrides})
    module = MlaAttention.init(config, settings(backend), key=jax.random.PRNGKey(seed))
    # random norm weights, so that a norm applied in the wrong place shows
    for i, name in enumerate(("q_a_norm", "kv_a_norm")):
        norm = getattr(module, name)
        if norm is not None:
            w = 1 + 0.5 * jax.random.normal(jax.random.PRNGKey(100 + i), norm.weight.array.shape)
            new = hax.named(w, norm.weight.axes)
            module = eqx.tree_at(lambda m, n=name: getattr(m, n).weight, module, new)
    return module


def hidden(seed=1, length=T, hidden_dim=32):
    x = jax.random.normal(jax.random.PRNGKey(seed), (B, length, hidden_dim))
    return hax.named(x, ("batch", "position", "embed"))


# ------------------------------------------------------------------ transformers parity
def _hf_linear(linear: hnn.Linear, out_axes, in_axes):
    """A haliax Linear's weight (and bias) as torch ``nn.Linear``'s ``[out, in]``."""
    w = linear.weight.rearrange((*out_axes, *in_axes)).array
    w = np.asarray(w).reshape(int(np.prod(w.shape[: len(out_axes)])), -1)
    b = None if linear.bias is None else np.asarray(linear.bias.rearrange(out_axes).array).ravel()
    return w, b


def hf_attention(module: MlaAttention):
    """transformers' DeepseekV3Attention (and its rotary embedding) holding ``module``'s weights."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    c = module.config
    rope = {"rope_type": "default", "rope_theta": c.rope.theta}
    if isinstance(c.rope, YarnRotary):
        rope = {"rope_theta": c.rope.theta, **c.rope.hf_rope_scaling()}
    config = DeepseekV3Config(
        hidden_size=c.hidden_dim, num_attention_heads=c.num_heads, num_key_value_heads=c.num_heads,
        q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim, rope_interleave=c.rope_interleave, rope_parameters=rope,
        attention_bias=c.attention_bias, rms_norm_eps=c.norm_eps, max_position_embeddings=32,
        num_hidden_layers=1, vocab_size=8, attention_dropout=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    attn, rotary = hf.DeepseekV3Attention(config, layer_idx=0), hf.DeepseekV3RotaryEmbedding(config)
    H, ax = "heads", {"qk": "head_size", "kv_b": "kv_b", "v": "v_head"}
    weights = {
        "kv_a_proj_with_mqa": _hf_linear(module.kv_a_proj, ("kv_a",), ("embed",)),
        "kv_b_proj": _hf_linear(module.kv_b_proj, (H, ax["kv_b"]), ("kv_lora",)),
        "o_proj": _hf_linear(module.o_proj, ("embed",), (H, ax["v"])),
    }
    if module.q_proj is not None:
        weights["q_proj"] = _hf_linear(module.q_proj, (H, ax["qk"]), ("embed",))
    else:
        weights["q_a_proj"] = _hf_linear(module.q_a_proj, ("q_lora",), ("embed",))
        weights["q_b_proj"] = _hf_linear(module.q_b_proj, (H, ax["qk"]), ("q_lora",))
        attn.q_a_layernorm.weight.data = torch.tensor(np.asarray(module.q_a_norm.weight.array))
    attn.kv_a_layernorm.weight.data = torch.tensor(np.asarray(module.kv_a_norm.weight.array))
    for name, (w, b) in weights.items():
        layer = getattr(attn, name)
        layer.weight.data = torch.tensor(w)
        if b is not None:
            layer.bias.data = torch.tensor(b)
    return attn, rotary


def hf_forward(module: MlaAttention, x) -> np.ndarray:
    import torch

    attn, rotary = hf_attention(module)
    xs = torch.tensor(np.asarray(x.rearrange(("batch", "position", "embed")).array))
    positions = torch.arange(xs.shape[1])[None].expand(xs.shape[0], -1)
    mask = torch.full((xs.shape[1], xs.shape[1]), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attn(xs, rotary(xs, positions), mask.expand(xs.shape[0], 1, -1, -1))
    return out.numpy()


def ours(module: MlaAttention, x, segment_ids=None) -> np.ndarray:
    out = eqx.filter_jit(lambda m, x: m(x, segment_ids))(module, x)
    return np.asarray(out.rearrange(("batch", "position", "embed")).array)


@pytest.mark.slow  # importing torch and transformers: ~10 s alone on a loaded host
@pytest.mark.parametrize("q_lora_rank", [None, 8], ids=["q_proj", "q_lora"])
def test_equals_transformers_deepseek_v3_attention(q_lora_rank):
    """Equal to DeepseekV3Attention in f32 (1e-5): YaRN with DeepSeek's mscale (the softmax
    temperature and cos/sin factor), interleaved rope pairs, v_head_dim != qk head dim, and
    with (q_a_proj, its norm, q_b_proj) or without (q_proj) the query bottleneck."""
    module, x = tiny(q_lora_rank, attention_bias=q_lora_rank is not None), hidden()
    assert module.config.softmax_scale() != module.config.qk_head_dim**-0.5  # YaRN's mscale
    np.testing.assert_allclose(ours(module, x), hf_forward(module, x), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # torch and transformers
def test_half_split_rope_without_yarn_equals_transformers():
    """``rope_interleave`` false and plain RoPE: still transformers' output."""
    module, x = tiny(8, rope=DefaultRotary(theta=500.0), rope_interleave=False), hidden()
    np.testing.assert_allclose(ours(module, x), hf_forward(module, x), atol=1e-5, rtol=1e-5)


def test_deepseek_v3_softmax_scale():
    """V3's shipped YaRN (factor 40, mscale_all_dim 1): 192 ** -0.5 x (0.1 ln 40 + 1) ** 2."""
    expected = 192**-0.5 * (0.1 * np.log(40.0) + 1) ** 2
    assert MlaConfig().softmax_scale() == pytest.approx(expected, rel=1e-12)
    assert MlaConfig().rope.attention_factor() == 1.0  # mscale == mscale_all_dim


def test_bad_shapes_are_refused_naming_the_field():
    """An odd rotary width (pairs) or a zero rank is a ConfigError naming the field."""
    with pytest.raises(ConfigError, match="qk_rope_head_dim"):
        MlaConfig(qk_rope_head_dim=3)
    with pytest.raises(ConfigError, match="kv_lora_rank=0"):
        MlaConfig(kv_lora_rank=0)


def test_deepseek_yarn_rope_scaling_round_trips():
    """DeepSeek-V3's ``rope_scaling`` (with mscale and mscale_all_dim) reads into YarnRotary
    and writes back the same; without them the entry is as before (Llama's YaRN)."""
    hf = {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip
    rope = RotaryConfig.from_hf(10000.0, hf)
    assert rope == MlaConfig().rope
    assert rope.hf_rope_scaling() == {
        "rope_type": "yarn",
        **{k: v for k, v in hf.items() if k != "type"},
    }
    assert "mscale" not in YarnRotary().hf_rope_scaling()
    assert YarnRotary(factor=4.0).attention_factor() == pytest.approx(0.1 * np.log(4.0) + 1)


# ------------------------------------------------------------------ backends
@pytest.mark.parametrize("backend", ["blockwise", "xla"])
def test_backends_agree_with_packed_documents(backend):
    """The padded q.k / v head dims run through the other backends: blockwise (blocks of
    8 over 16 positions) and jax.nn's, with packed-document masks, equal vanilla."""
    segments = hax.named(
        jnp.asarray([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4]), ("batch", "position")
    )
    reference = ours(tiny(8), hidden(), segments)
    out = ours(tiny(8, backend=backend), hidden(), segments)
    np.testing.assert_allclose(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # two backward passes to compile: ~5 s
def test_blockwise_gradients_equal_vanilla():
    """Training through blockwise (its own backward pass) with the padded head dims: the
    weights' gradients equal those through vanilla."""

    def grads(module):
        loss = lambda m, x: hax.sum(m(x) ** 2).scalar()  # noqa: E731
        return jax.tree.leaves(eqx.filter_jit(eqx.filter_grad(loss))(module, hidden()))

    for got, want in zip(grads(tiny(8, backend="blockwise")), grads(tiny(8)), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # a fresh process on 8 fake CPU devices: ~30 s
def test_context_parallel_training_equals_one_device(json_worker):
    """Data 2 x context 4, the ring carrying the padded keys and values, the sequence
    zig-zag laid out (rotary at the true positions), documents crossing the shards: the
    output and the weights' gradients equal one device's (relative to the gradients' size)."""
    result = json_worker(Path(__file__).with_name("mla_context_parallel_run.py"))["ring"]
    assert result["out"] < 1e-5, result
    assert result["weights"] < 2e-6 * result["scale"], result


def test_split_decoding_is_refused(monkeypatch):
    """Decoding with the sequence split over ``context`` says so in one line."""
    monkeypatch.setattr(mla, "context_ways", lambda: 2)
    module = tiny(8)
    cache = module.config.init_cache((hax.Axis("batch", B),), T, jnp.float32)
    with pytest.raises(ConfigError, match=r"trainer\.mesh\.context"):
        module.decode(hidden(length=1), cache, jnp.int32(0))


# ------------------------------------------------------------------ decoding
def decode_in_steps(module: MlaAttention, x, prefill: int):
    """``x``'s first ``prefill`` positions in one decode call, then one position a step."""
    cache = module.config.init_cache((x.resolve_axis("batch"),), T, jnp.float32)
    step = eqx.filter_jit(lambda m, x, cache, start: m.decode(x, cache, start))
    outs, cache = [], cache
    bounds = [0, prefill, *range(prefill + 1, T + 1)]
    for lo, hi in itertools.pairwise(bounds):
        out, cache = step(module, x["position", lo:hi], cache, jnp.int32(lo))
        outs.append(np.asarray(out.rearrange(("batch", "position", "embed")).array))
    return np.concatenate(outs, axis=1), cache


def test_decode_over_latent_cache_equals_full_recompute():
    """A prefill of 10 positions then 6 single steps over the cache (absorbed up-projections)
    give the full forward's outputs; the cache holds only the normed latent and the rotated
    rope key (kv_lora + qk_rope values a token), equal to what the forward computes."""
    module, x = tiny(8), hidden()
    out, cache = decode_in_steps(module, x, prefill=10)
    np.testing.assert_allclose(out, ours(module, x), atol=1e-5, rtol=1e-5)
    assert isinstance(cache, MlaCache)
    assert cache.latent.array.shape == (B, T, 16) and cache.k_rope.array.shape == (B, T, 4)
    latents = eqx.filter_jit(lambda m, x: m._latents(x, hax.arange(x.resolve_axis("position"))))
    latent, k_rope = latents(module, x)
    np.testing.assert_allclose(cache.latent.array, latent.array, atol=1e-6)
    np.testing.assert_allclose(cache.k_rope.array, k_rope.array, atol=1e-6)


class Block(eqx.Module):
    """A residual MLA block, enough to run ``decode_layers``."""

    attn: MlaAttention

    @staticmethod
    def init(key):
        return Block(
            tiny(8, seed=0).__class__.init(MlaConfig(**TINY, q_lora_rank=8), settings(), key=key)
        )

    def __call__(self, x):
        return x + self.attn(x)

    def decode(self, x, cache, start):
        out, cache = self.attn.decode(x, cache, start)
        return x + out, cache


@pytest.mark.slow  # ~3 s: two compiled decode shapes and a recompute
def test_greedy_tokens_through_decode_layers():
    """Two MLA blocks (embedding and tied head around them) through the shared decode loop
    (``decode_layers`` over a layered ``MlaCache``): 8 greedy tokens after a 4-token prompt
    equal those of recomputing the whole sequence each step, and so do the last logits."""
    Layers, Vocab, Embed = hax.Axis("layers", 2), hax.Axis("vocab", 16), hax.Axis("embed", 32)
    stack = hnn.Stacked.init(Layers, Block)(key=jax.random.split(jax.random.PRNGKey(3), 2))
    embed = hax.random.normal(jax.random.PRNGKey(4), (Vocab, Embed))
    batch = hax.Axis("batch", B)

    def logits(x):
        return hax.dot(x, embed, axis=Embed)

    @jax.jit
    def recompute(tokens, length):  # the whole buffer; causal, so the tail is ignored
        return logits(stack.fold(embed.take(Vocab, tokens)))["position", length - 1]

    @jax.jit
    def cached(tokens, cache, start):
        x, cache = decode_layers(embed.take(Vocab, tokens), [stack], cache, start)
        return logits(x)["position", -1], cache

    prompt = jnp.asarray([[1, 5, 2, 7], [3, 3, 9, 0]])
    full = np.zeros((B, 12), np.int32)
    full[:, :4] = prompt
    cache = MlaConfig(**TINY, q_lora_rank=8).init_cache((batch,), T, jnp.float32, layers=Layers)
    step_in, fast = prompt, [prompt]
    for length in range(4, 12):
        slow_logits = recompute(hax.named(jnp.asarray(full), (batch, "position")), length)
        full[:, length] = np.asarray(hax.argmax(slow_logits, Vocab).array)
        tokens = hax.named(step_in, (batch, "position"))
        start = length - step_in.shape[1]
        fast_logits, cache = cached(tokens, cache, jnp.int32(start))
        step_in = hax.argmax(fast_logits, Vocab).array[:, None]
        fast.append(step_in)
        np.testing.assert_allclose(fast_logits.array, slow_logits.array, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.concatenate(fast, axis=1), full)


def test_cache_is_under_an_eighth_of_llamas_per_token_at_deepseek_v3_shape():
    """Bytes per cached token, from the caches' own arrays (bf16, 2 layers): MLA at V3's
    shape holds 512 + 64 values a layer; a Llama-style cache 2 x 128 heads x 128."""
    v3, Layers, batch = MlaConfig(), hax.Axis("layers", 2), (hax.Axis("batch", 1),)
    ours_bytes = cache_bytes_per_token(v3.init_cache(batch, 4, jnp.bfloat16, layers=Layers))
    axes = (Layers, *batch, hax.Axis("key_position", 4), hax.Axis("kv_heads", 128))
    axes = (*axes, hax.Axis("head_size", 128))
    llama_bytes = cache_bytes_per_token(KvCache(*(hax.zeros(axes, jnp.bfloat16),) * 2))
    assert ours_bytes == 2 * (512 + 64) * 2 and llama_bytes == 2 * 2 * 128 * 128 * 2
    assert ours_bytes <= llama_bytes / 8  # 576 / 32768 = 1/56.9
