"""QK-clip: per head, the largest logit over the threshold comes back to it; others untouched;
wired into the train step for a Llama and a DeepSeek-V3 (MLA, MTP)."""

from __future__ import annotations

import functools
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

from loomax.lm import lm_loss
from loomax.models import LlamaConfig, MoeConfig
from loomax.models.attention import max_logits
from loomax.models.attention.rotary import DefaultRotary
from loomax.models.families.deepseek_v3 import DeepseekV3Config
from loomax.optim import AdamConfig
from loomax.optim.qk_clip import clip_model, qk_clip
from loomax.train import TrainerState, make_train_step
from loomax.train.step import trainable_params

CONFIG = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=16, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=4)  # fmt: skip


@eqx.filter_jit  # one program (op by op, each projection's ops compiled on their own)
def projections(attn, x):
    q = attn.q_proj(x).rearrange(("layers", "position", "heads", "head_size")).array[0]
    k = attn.k_proj(x).rearrange(("layers", "position", "kv_heads", "head_size")).array[0]
    return q, k


def logits(attn, x):
    """Per query head, q . k over every (query, key) position pair, unscaled (no rotary)."""
    q, k = projections(attn, x)
    k = np.repeat(np.asarray(k), 2, axis=1)  # query head h reads key head h // 2
    return np.einsum("phd,shd->hps", np.asarray(q), k)


def test_heads_over_the_threshold_come_back_to_it_exactly():
    model = CONFIG.build(32, key=jax.random.PRNGKey(0))
    named = lambda x: isinstance(x, hax.NamedArray)  # noqa: E731
    attn = jax.tree.map(lambda x: x * 3.0, model.blocks.stacked.attn, is_leaf=named)  # 1 layer
    x = hax.random.normal(jax.random.PRNGKey(1), (hax.Axis("position", 8), hax.Axis("embed", 16)))
    before = np.abs(logits(attn, x)).max(axis=(1, 2))
    threshold = float(np.sort(before)[1])  # two heads over it, two under
    clipped = eqx.filter_jit(qk_clip)(attn, hax.named(before[None], ("layers", "heads")), threshold)
    after = np.abs(logits(clipped, x)).max(axis=(1, 2))
    np.testing.assert_allclose(after, np.minimum(before, threshold), rtol=1e-4)
    v = clipped.v_proj.weight.array
    np.testing.assert_array_equal(v, attn.v_proj.weight.array)


def test_qk_norm_is_refused():
    model = LlamaConfig(**{**CONFIG.__dict__, "qk_norm": True}).build(32, key=jax.random.PRNGKey(0))
    attn = model.blocks.stacked.attn
    with pytest.raises(ValueError, match="QK-norm"):
        qk_clip(attn, hax.named(np.ones(4), "heads"), 1.0)


# ---------------------------------------------------------------- wired into the train step
F32 = jmp.get_policy("f32")
VOCAB = 64
LLAMA = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=1, num_heads=4,
                    num_kv_heads=4, attn_backend="blockwise", flash_attention_block_size=8)  # fmt: skip
DEEPSEEK = DeepseekV3Config(
    seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=2, num_heads=4, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mtp_depth=1,
    rope=DefaultRotary(theta=10000.0), attn_backend="vanilla",
    moe=MoeConfig(num_experts=4, num_experts_per_tok=2, expert_intermediate_dim=16,
                  score_function="sigmoid", num_shared_experts=1, num_groups=2, topk_groups=1,
                  routing_bias=True, first_dense_layers=1),
)  # fmt: skip


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (4, 16), dtype=np.int32)


@jax.jit
def maxima(model, batch):
    """The per-head maximum logits of ``batch`` by stack, as the step collects them."""
    with max_logits.collecting() as seen:
        lm_loss()(model, batch, key=None)
    return dict(seen)


@functools.cache
def built(config):
    """``config``'s model (key 0), built once (the steps do not donate it). Op by op: a jitted
    build compiles one large init program (2.5 CPU-s for the DeepSeek-V3 here) against ops
    that other tests have mostly compiled already."""
    return config.build(VOCAB, key=jax.random.PRNGKey(0))


@functools.cache
def one_step(config, tau):
    """(model before, maxima before, model after one Adam step with ``qk_clip_tau=tau``,
    the step's metrics)."""
    model = built(config)
    opt = AdamConfig(learning_rate=1e-4, warmup=0, weight_decay=0.0).build(10)
    state = TrainerState(jnp.zeros((), jnp.int32), model,
                         opt.init(trainable_params(model)), jax.random.PRNGKey(1))  # fmt: skip
    step = jax.jit(make_train_step(lm_loss(), opt, mp=F32, qk_clip_tau=tau))
    after, metrics = step(state, tokens())
    return after.model, metrics


def threshold(seen) -> float:
    """Between the two middle heads' maxima: some heads over it, some under."""
    values = np.sort(np.concatenate([np.ravel(v.array) for v in seen.values()]))
    return float(values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def runs(request):
    config = {"llama": LLAMA, "deepseek_v3": DEEPSEEK}[request.param]
    before = maxima(built(config), tokens())
    tau = threshold(before)
    return request.param, before, tau, one_step(config, None), one_step(config, tau)


def head_rows(model, name: str):
    """Each clipped projection's weight as ``[layers?, heads, ...]`` arrays, by leaf name."""
    attn = model.qk_clip_attention()[name](model)
    if hasattr(attn, "kv_b_proj"):
        parts = {"q": attn.q_b_proj.weight, "kv_b": attn.kv_b_proj.weight}
    else:
        parts = {"q": attn.q_proj.weight, "k": attn.k_proj.weight, "k_bias": attn.k_proj.bias}
    lead = [a for a in ("layers", "heads", "kv_heads") if any(x.name == a for x in next(iter(parts.values())).axes)]  # fmt: skip
    out = {}
    for key, w in parts.items():
        if w is not None:
            head = "heads" if w.has_axis("heads") else "kv_heads"
            order = tuple(a for a in lead if a != "heads" and a != "kv_heads") + (head,)
            out[key] = np.asarray(w.rearrange((*order, ...)).array)
    return out


def test_clipped_heads_come_back_to_tau_and_the_rest_are_untouched(runs):
    family, before, tau, (off, _), (clipped, metrics) = runs
    over = {k: np.asarray(v.array) > tau for k, v in before.items()}
    assert 0 < sum(o.sum() for o in over.values()) < sum(o.size for o in over.values())
    assert float(metrics["optim/qk_clipped_heads"]) == sum(o.sum() for o in over.values())
    assert float(metrics["optim/max_logit"]) == max(float(v.array.max()) for v in before.values())
    after = maxima(clipped, tokens())
    first = next(iter(before))  # the first stack sees the embeddings only: exactly comparable
    assert float(after[first].array.max()) <= tau * 1.01
    if family == "deepseek_v3":
        assert set(before) == {"layers_from_0", "layers_from_1", "mtp_1"}
        np.testing.assert_array_equal(  # the shared rotary key is never clipped
            clipped.blocks.stacked.attn.kv_a_proj.weight.array, off.blocks.stacked.attn.kv_a_proj.weight.array
        )  # fmt: skip
    # the step's clip is the optimizer's update, then clip_model (to the last bit of XLA's
    # fusion of the two), and clip_model leaves the heads under tau exactly as they were
    expected, _ = jax.jit(clip_model, static_argnums=2)(off, before, tau)
    for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    for name, hot in over.items():
        kept, ran = head_rows(expected, name), head_rows(off, name)
        for part in kept:
            np.testing.assert_array_equal(kept[part][~hot], ran[part][~hot])
            assert not np.allclose(kept[part][hot], ran[part][hot], rtol=1e-3)


def test_a_threshold_no_head_reaches_keeps_the_trajectory_bitwise():
    (off, m_off), (far, m_far) = one_step(LLAMA, None), one_step(LLAMA, 1e9)
    assert float(m_far["optim/qk_clipped_heads"]) == 0
    assert float(m_off["train/loss"]) == float(m_far["train/loss"])
    for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(far), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sharded_clip_gives_one_devices_trajectory(json_worker):
    """FSDP and tensor parallel (data 4 x model 2, 8 fake CPU devices): the clipped q/k
    projections are split; the losses, maxima and final weights are one device's."""
    out = json_worker(Path(__file__).with_name("qk_clip_run.py"), devices=8)
    one, split = out["one"], out["split"]
    assert "model" in split["q_spec"] and "data" in split["q_spec"], split["q_spec"]
    assert all(m[2] > 0 for m in one["metrics"])  # heads are clipped every step
    np.testing.assert_allclose(split["metrics"], one["metrics"], rtol=2e-5)
    np.testing.assert_allclose(split["q_final"], one["q_final"], rtol=1e-4, atol=1e-6)
