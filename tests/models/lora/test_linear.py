"""LoRA adapters on a tiny Llama (models/lora): the first step's model is the base exactly;
merging gives the adapted model's logits; the trainer's freeze (from model.lora) leaves
gradients and optimizer state to the adapters alone (bytes measured); bad settings fail
naming the key; adapters saved alone load back; Llama 3.2 1B's adapter state is <= 2% of
full fine-tuning's (eval_shape count)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from loomax.config import ConfigError, parse_config
from loomax.lm import TrainLmConfig
from loomax.models import Gpt2Config, LlamaConfig
from loomax.models.lora.config import LoraConfig
from loomax.models.lora.files import load_adapters, save_adapters
from loomax.models.lora.linear import LoraLinear, adapter_layers, merge_lora, without_adapters
from loomax.optim import AdamConfig
from loomax.train.step import trainable_mask, trainable_params
from loomax.tree_paths import named_leaves

VOCAB = 61
BASE = LlamaConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
)
LORA = LoraConfig(targets=("attn", "mlp"), rank=4, alpha=8.0)
IDS = hax.named(np.arange(16) % VOCAB, "position")


def nudged(model):
    """``model`` with every B set to random values (a trained adapter)."""

    def bump(layer):
        b = hax.random.normal(jax.random.PRNGKey(1), layer.lora_b.axes) * 0.1
        return eqx.tree_at(lambda m: m.lora_b, layer, b)

    is_lora = lambda x: isinstance(x, LoraLinear)  # noqa: E731
    return jax.tree.map(lambda n: bump(n) if is_lora(n) else n, model, is_leaf=is_lora)


@pytest.fixture(scope="module")
def models():
    config = dataclasses.replace(BASE, lora=LORA)
    base = config.build(VOCAB, key=jax.random.PRNGKey(0))  # no adapters: build adds none
    return config, base, config.for_training(base)


def logits(model):
    return np.asarray(model.logits(IDS).array)


def bytes_of(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def test_fresh_adapters_compute_the_base_model_exactly(models):
    _, base, model = models
    assert sorted(adapter_layers(model)) == [
        f"blocks.stacked.{m}" for m in ("attn.k_proj", "attn.o_proj", "attn.q_proj",
        "attn.v_proj", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")
    ]  # fmt: skip
    np.testing.assert_array_equal(logits(model), logits(base))


def test_merged_and_unmerged_agree_and_the_base_comes_back(models):
    _, base, model = models
    trained = nudged(model)
    assert np.abs(logits(trained) - logits(base)).max() > 0.1
    merged = merge_lora(trained)
    assert not adapter_layers(merged)
    np.testing.assert_allclose(logits(merged), logits(trained), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(logits(without_adapters(trained)), logits(base))


def test_only_adapters_get_gradients_and_optimizer_state(models):
    config, base, model = models
    run = TrainLmConfig(model=config)
    freeze = run.trainer.freeze
    assert freeze == LORA.freeze_patterns()
    trained, _ = eqx.partition(model, trainable_mask(model, freeze))
    names = [n for n, x in named_leaves(trained, ".") if getattr(x, "array", x) is not None]
    assert len(names) == 14 and all(n.endswith((".lora_a", ".lora_b")) for n in names), names
    optimizer = AdamConfig(learning_rate=1e-3).build(10)
    full = bytes_of(optimizer.init(trainable_params(base)))
    lora = bytes_of(optimizer.init(trainable_params(model, freeze)))
    adapters = sum(bytes_of((x.lora_a, x.lora_b)) for x in adapter_layers(model).values())
    assert lora <= 2 * adapters + 64  # Adam's two moments of the adapters, and a count
    assert lora < 0.2 * full, (lora, full)


def test_bad_settings_name_the_key(models, families):
    with pytest.raises(ConfigError, match="model.lora.rank"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="model.lora.dropout"):
        LoraConfig(dropout=1.0)
    config = dataclasses.replace(BASE, lora=LoraConfig(targets=("attn", "qkv_fused")))
    with pytest.raises(ConfigError, match=r"model.lora.targets: 'qkv_fused' matches no linear"):
        config.for_training(models[1])
    # MoE routers never get adapters: a target naming only them matches nothing
    moe = families.tiny_config("mixtral", lora=LoraConfig(targets=("router",)))
    with pytest.raises(
        ConfigError, match=r"'router' matches no linear layer or expert weight of MixtralLmModel"
    ):
        moe.for_training(moe.build(VOCAB, key=jax.random.PRNGKey(0)))


def test_adapters_saved_alone_load_back(models, tmp_path):
    _, _, model = models
    trained = nudged(model)
    path = save_adapters(trained, tmp_path)
    assert path.stat().st_size < 0.5 * bytes_of(eqx.filter(model, eqx.is_inexact_array))
    np.testing.assert_array_equal(logits(load_adapters(model, tmp_path)), logits(trained))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_adapter_dropout_acts_in_training_only(family):
    lora = dataclasses.replace(LORA, dropout=0.5)
    config = (
        BASE
        if family == "llama"
        else Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)
    )
    config = dataclasses.replace(config, lora=lora)
    assert config.dropout_active
    model = nudged(config.for_training(config.build(VOCAB, key=jax.random.PRNGKey(0))))
    trained = np.asarray(model.hidden_states(IDS, key=jax.random.PRNGKey(5)).array)
    evaluated = np.asarray(model.hidden_states(IDS).array)
    assert np.abs(trained - evaluated).max() > 1e-3


def test_llama_1b_adapter_state_is_at_most_2_percent_of_full(repo_root: Path):
    run = parse_config(TrainLmConfig, repo_root / "config" / "llama_1b.yaml")
    lora_config = LoraConfig()  # the defaults: rank 8 on every attention and MLP projection
    model_config = dataclasses.replace(run.model, lora=lora_config)
    optimizer = AdamConfig().build(10)

    def state_bytes(lora: bool) -> int:
        def init(key):
            model = model_config.build(50257, key=key)
            model = model_config.for_training(model) if lora else model
            freeze = lora_config.freeze_patterns() if lora else ()
            return optimizer.init(trainable_params(model, freeze))

        return bytes_of(jax.eval_shape(init, jax.random.PRNGKey(0)))

    full, lora = state_bytes(False), state_bytes(True)
    print(f"llama_1b Adam state: full {full / 2**30:.2f} GiB, LoRA r=8 {lora / 2**20:.1f} MiB")
    assert lora <= 0.02 * full, (lora, full)
