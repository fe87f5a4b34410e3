"""DoRA (model.lora.dora, models/lora/dora.py) on a tiny Llama: fresh adapters give the
base's logits exactly; a trained adapter (B and the magnitudes moved) merges into weights
with the same logits; the magnitudes train beside A and B (the freeze keeps them) and get
gradients; DoRA on expert weights is refused naming the key. The PEFT parity (use_dora) is
in tests/hf/test_peft.py."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.lm import TrainLmConfig
from loomax.models import LlamaConfig, MixtralConfig, MoeConfig
from loomax.models.lora.config import LoraConfig
from loomax.models.lora.linear import LoraLinear, merge_lora, without_adapters
from loomax.models.loss import next_token_loss
from loomax.train.step import trainable_mask
from loomax.tree_paths import named_leaves

VOCAB = 61
LORA = LoraConfig(targets=("attn", "mlp"), rank=4, alpha=8.0, dora=True)
CONFIG = LlamaConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
    lora=LORA,
)  # fmt: skip
IDS = hax.named(np.arange(16) % VOCAB, "position")


def nudged(model):
    """``model`` with every B and magnitude offset random (a trained DoRA adapter)."""

    def bump(layer):
        b = hax.random.normal(jax.random.PRNGKey(1), layer.lora_b.axes) * 0.1
        m = hax.random.normal(jax.random.PRNGKey(2), layer.lora_m.axes) * 0.2
        return eqx.tree_at(lambda x: (x.lora_b, x.lora_m), layer, (b, m))

    is_lora = lambda x: isinstance(x, LoraLinear)  # noqa: E731
    return jax.tree.map(lambda n: bump(n) if is_lora(n) else n, model, is_leaf=is_lora)


@pytest.fixture(scope="module")
def models():
    base = CONFIG.build(VOCAB, key=jax.random.PRNGKey(0))
    return base, CONFIG.for_training(base)


def logits(model):
    return np.asarray(model.logits(IDS).array)


def test_fresh_dora_adapters_compute_the_base_exactly(models):
    base, model = models
    q = model.blocks.stacked.attn.q_proj
    assert [a.name for a in q.lora_m.axes] == ["layers", "heads", "head_size"]  # q's outputs
    np.testing.assert_array_equal(logits(model), logits(base))


def test_merged_dora_gives_the_same_logits(models):
    base, model = models
    trained = nudged(model)
    assert np.abs(logits(trained) - logits(base)).max() > 0.1
    merged = eqx.filter_jit(merge_lora)(trained)  # one program (op by op: a few hundred)
    np.testing.assert_allclose(logits(merged), logits(trained), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(logits(without_adapters(trained)), logits(base))
    # the magnitude alone rescales each output unit: B = 0, m = 2 ||W|| doubles q_proj's rows
    q = model.blocks.stacked.attn.q_proj
    doubled = eqx.tree_at(lambda m: m.lora_m, q, q.magnitude().astype(q.lora_m.dtype))
    x = hax.random.normal(jax.random.PRNGKey(3), (q.In,))
    np.testing.assert_allclose(
        np.asarray(doubled(x).array), 2 * np.asarray(q(x).array), rtol=1e-5, atol=1e-6
    )


def test_magnitudes_train_beside_a_and_b(models):
    _, model = models
    freeze = TrainLmConfig(model=CONFIG).trainer.freeze
    mask = trainable_mask(model, freeze)
    trained, rest = eqx.partition(model, mask)
    names = [n for n, x in named_leaves(trained, ".") if getattr(x, "array", x) is not None]
    assert len(names) == 21 and sum(n.endswith(".lora_m") for n in names) == 7, names
    batch = hax.named(np.stack([np.arange(16) % VOCAB] * 2), ("batch", "position"))

    def loss(t):
        total, count = next_token_loss(eqx.combine(t, rest), batch, block_size=None)
        return total / count

    grads = jax.jit(jax.grad(loss))(trained)  # one program (op by op: ~2.5x the CPU)
    m_grad = grads.blocks.stacked.attn.q_proj.lora_m.array
    assert np.abs(np.asarray(m_grad)).max() > 0  # the magnitude learns from step 0


def test_dora_on_experts_is_refused():
    moe = MixtralConfig(
        seq_len=16, hidden_dim=16, intermediate_dim=16, num_layers=1, num_heads=4,
        num_kv_heads=2, moe=MoeConfig(num_experts=4), lora=dataclasses.replace(LORA),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="model.lora.dora .*blocks.stacked.mlp.gate"):
        moe.for_training(moe.build(VOCAB, key=jax.random.PRNGKey(0)))
