"""LoRA on a mixture of experts' expert weights (models/lora/experts.py) on a tiny Mixtral:
the targets select the stacked expert weights by name; the first step's model is the base
exactly; merging gives the adapted logits; the trainer's freeze leaves gradients and
optimizer state to the adapters alone (bytes measured); dropout or a quantised base on
experts is refused naming the key; adapters saved alone load back; under expert parallelism
(8 fake CPU devices, expert 2 x data 4) the losses equal one device's and the adapters'
expert axis is split as the experts are."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.lm import TrainLmConfig
from loomax.models import MixtralConfig, MoeConfig
from loomax.models.lora.config import LoraConfig
from loomax.models.lora.files import load_adapters, save_adapters
from loomax.models.lora.linear import adapter_layers, merge_lora, without_adapters
from loomax.models.moe.expert_adapter import ExpertAdapter
from loomax.optim import AdamConfig
from loomax.train.step import trainable_mask, trainable_params
from loomax.tree_paths import named_leaves

VOCAB = 61
LORA = LoraConfig(targets=("mlp",), rank=4, alpha=8.0)
BASE = MixtralConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
    moe=MoeConfig(num_experts=4, num_experts_per_tok=2, matmul_block=8),
)  # fmt: skip
IDS = hax.named(np.arange(16) % VOCAB, "position")
WORKER = Path(__file__).with_name("lora_experts_run.py")


def nudged(model):
    """``model`` with every expert adapter's B random (a trained adapter)."""

    def bump(adapter):
        b = hax.random.normal(jax.random.PRNGKey(1), adapter.lora_b.axes) * 0.3
        return eqx.tree_at(lambda m: m.lora_b, adapter, b)

    is_adapter = lambda x: isinstance(x, ExpertAdapter)  # noqa: E731
    return jax.tree.map(lambda n: bump(n) if is_adapter(n) else n, model, is_leaf=is_adapter)


@pytest.fixture(scope="module")
def models():
    config = dataclasses.replace(BASE, lora=LORA)
    base = config.build(VOCAB, key=jax.random.PRNGKey(0))
    return config, base, config.for_training(base)


def logits(model):
    """``model``'s logits of ``IDS``, as one compiled forward per model structure (op by op,
    the routed experts compile ~100 small programs)."""
    return np.asarray(_jit_logits(model))


@eqx.filter_jit
def _jit_logits(model):
    return model.logits(IDS).array


def bytes_of(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def test_fresh_expert_adapters_compute_the_base_exactly(models):
    _, base, model = models
    assert sorted(adapter_layers(model)) == [
        f"blocks.stacked.mlp.{w}_lora" for w in ("down", "gate", "up")
    ]
    up = model.blocks.stacked.mlp.up_lora
    assert [a.name for a in up.lora_a.axes] == ["layers", "experts", "lora_r", "embed"]
    assert [a.name for a in up.lora_b.axes] == ["layers", "experts", "mlp", "lora_r"]
    np.testing.assert_array_equal(logits(model), logits(base))


def test_merged_and_unmerged_agree_and_the_base_comes_back(models):
    _, base, model = models
    trained = nudged(model)
    assert np.abs(logits(trained) - logits(base)).max() > 0.1
    merged = merge_lora(trained)
    assert not adapter_layers(merged) and merged.blocks.stacked.mlp.gate_lora is None
    np.testing.assert_allclose(logits(merged), logits(trained), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(logits(without_adapters(trained)), logits(base))


def test_a_pattern_selects_one_expert_weight(models):
    config = dataclasses.replace(BASE, lora=dataclasses.replace(LORA, targets=(r"mlp\.up$",)))
    model = config.for_training(models[1])
    assert list(adapter_layers(model)) == ["blocks.stacked.mlp.up_lora"]


def test_only_adapters_get_gradients_and_optimizer_state(models):
    config, base, model = models
    freeze = TrainLmConfig(model=config).trainer.freeze
    trained, _ = eqx.partition(model, trainable_mask(model, freeze))
    names = [n for n, x in named_leaves(trained, ".") if getattr(x, "array", x) is not None]
    assert sorted(names) == sorted(
        f"blocks.stacked.mlp.{w}_lora.lora_{ab}" for w in ("gate", "up", "down") for ab in "ab"
    )
    optimizer = AdamConfig(learning_rate=1e-3).build(10)
    full = bytes_of(optimizer.init(trainable_params(base)))
    lora = bytes_of(optimizer.init(trainable_params(model, freeze)))
    adapters = sum(bytes_of((x.lora_a, x.lora_b)) for x in adapter_layers(model).values())
    assert lora <= 2 * adapters + 64  # Adam's two moments of the adapters, and a count
    assert lora < 0.2 * full, (lora, full)


def test_dropout_or_a_quantised_base_on_experts_is_refused(models):
    for setting, key in (({"dropout": 0.1}, "dropout"), ({"quantize_base": "int8"}, "quantize")):
        config = dataclasses.replace(BASE, lora=dataclasses.replace(LORA, **setting))
        with pytest.raises(ConfigError, match=rf"model.lora.{key}.*blocks.stacked.mlp.gate"):
            config.for_training(models[1])


def test_expert_adapters_saved_alone_load_back(models, tmp_path):
    _, _, model = models
    trained = nudged(model)
    save_adapters(trained, tmp_path)
    np.testing.assert_array_equal(logits(load_adapters(model, tmp_path)), logits(trained))


@pytest.mark.slow
def test_expert_parallel_lora_matches_one_device(json_worker):
    out = json_worker(WORKER, devices=8)
    one, split = out["one"], out["expert2_data4"]
    assert split["mesh"]["expert"] == 2 and split["mesh"]["data"] == 4
    assert len(one["losses"]) == 5 and all(math.isfinite(x) for x in one["losses"])
    np.testing.assert_allclose(split["losses"], one["losses"], rtol=1e-5)
    assert split["base_unchanged"] and split["up_lora_b_max"] > 0  # adapters alone trained
    placed = split["placement"]
    for name, where in placed.items():  # the experts axis on `expert`, as the weights'
        assert split["axes"][name][1] == "experts"
        assert where["spec"].startswith("P(None, 'expert'"), (name, where)
        assert where["device_shape"][1] == 2  # 4 experts over 2 ways: 2 a device
    # a device holds its experts' adapters: A's input axis is also split over data (FSDP)
    # as its weight's is, so a device holds 1/8 of A, 1/2 of B (rank never split)
    assert placed["gate_lora_a"]["device_bytes"] * 8 == placed["gate_lora_a"]["bytes"]
    assert placed["gate_lora_b"]["device_bytes"] * 2 == placed["gate_lora_b"]["bytes"]
    assert placed["gate"]["device_bytes"] * 8 == placed["gate"]["bytes"]
