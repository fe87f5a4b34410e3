"""QLoRA (model.lora.quantize_base): the frozen base stored as int8 or nf4 blocks with scales,
dequantised per matmul; step 0 close to the unquantised base (errors measured); the codes
take 1/4 (int8) or 1/8 (nf4) of float32's bytes; the trainer trains the adapters on it, the
codes unchanged; a checkpoint holds the codes and resumes."""

from __future__ import annotations

import dataclasses
import tempfile

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.data import BatchLoader, TokenWindows
from loomax.lm.loss import lm_loss_for
from loomax.models import LlamaConfig
from loomax.models.lora.config import LoraConfig
from loomax.models.lora.linear import adapter_layers, merge_lora, without_adapters
from loomax.models.lora.quantized import nf4_levels, quantize
from loomax.optim import AdamConfig
from loomax.tracking import NoopTrackerConfig
from loomax.train import Trainer, TrainerConfig

VOCAB = 61
BASE = LlamaConfig(
    seq_len=32, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2
)
IDS = hax.named(np.arange(32) % VOCAB, "position")


@eqx.filter_jit  # one program a model (op by op: each model's ops compiled one by one)
def logits(model):
    return model.logits(IDS).array


def test_blockwise_codes_hold_the_weight():
    levels = nf4_levels()
    assert len(levels) == 16 and levels[0] == -1 and levels[-1] == 1 and 0 in levels
    assert np.all(np.diff(levels) > 0)
    w = hax.random.normal(jax.random.PRNGKey(0), (hax.Axis("out", 6), hax.Axis("embed", 128)))
    for kind, bound in (("int8", 0.5 / 127), ("nf4", 0.5 * np.diff(levels).max())):
        q = eqx.filter_jit(quantize)(w, hax.Axis("embed", 128), kind, 64)  # one program
        assert q.scales.axes == (hax.Axis("out", 6), hax.Axis("embed", 2))
        back = np.asarray(eqx.filter_jit(lambda q: q.dequantize().array)(q))
        blocks = np.abs(np.asarray(w.array)).reshape(6, 2, 64).max(-1, keepdims=True)
        error = np.abs(back - np.asarray(w.array)).reshape(6, 2, 64) / blocks
        assert error.max() <= bound + 1e-6, (kind, error.max())
    assert q.codes.array.dtype == jnp.uint8  # the loop's last kind: nf4


@pytest.fixture(scope="module")
def base():
    return BASE.build(VOCAB, key=jax.random.PRNGKey(0))


def qlora(kind: str) -> LlamaConfig:
    return dataclasses.replace(BASE, lora=LoraConfig(rank=4, alpha=8.0, quantize_base=kind))


@pytest.mark.parametrize("kind,max_error,ratio", [("int8", 0.05, 0.28), ("nf4", 0.5, 0.16)])
def test_step_0_is_close_to_the_base_and_the_store_shrinks(base, kind, max_error, ratio):
    """Logits' error relative to their norm: int8 0.17%, nf4 ~11% (a random tiny model)."""
    # quantising and merging each as one program (op by op: a few hundred small ones)
    model = eqx.filter_jit(qlora(kind).for_training)(base)
    layers = adapter_layers(model)
    assert len(layers) == 7 and all(x.weight is None for x in layers.values())
    ref, out = (np.asarray(logits(m)) for m in (base, model))
    error = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"{kind}: step 0 logits' relative error {error:.4f}")
    assert error < max_error
    stores = sum(x.quantized.nbytes for x in layers.values())
    # the float32 weights' bytes, from their shapes (dequantising each just to count, op by op,
    # compiled a handful of small programs a layer)
    weights = lambda ls: [without_adapters(x).weight for x in ls]  # noqa: E731
    unquantised = eqx.filter_eval_shape(weights, list(layers.values()))
    plain = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(unquantised))
    assert stores <= ratio * plain, (stores, plain)  # codes + float32 scales, blocks of 64
    # the export's view: merged, and the base, are the dequantised weights (plus B A)
    np.testing.assert_allclose(
        np.asarray(logits(eqx.filter_jit(merge_lora)(model))), out, rtol=1e-5, atol=1e-5
    )


def test_a_quantised_base_cannot_train_and_bad_kinds_name_the_key():
    with pytest.raises(ConfigError, match="model.lora.quantize_base"):
        LoraConfig(quantize_base="int4")
    with pytest.raises(ConfigError, match="model.lora.quantize_base .*train_base"):
        LoraConfig(quantize_base="nf4", train_base=True)


@pytest.mark.slow
def test_qlora_trains_the_adapters_on_the_frozen_codes(base):
    """20 steps on a repeating sequence: the loss falls; the codes and scales are unchanged;
    the checkpoint holds them and the run resumes from it."""
    config = qlora("nf4")
    run_dir = tempfile.mkdtemp()
    trainer_config = TrainerConfig(
        num_train_steps=20, train_batch_size=4, progress_bar=False, run_dir=run_dir,
        tracker=NoopTrackerConfig(), freeze=config.lora.freeze_patterns(),
    )  # fmt: skip
    losses: list[float] = []
    optimizer = AdamConfig(learning_rate=1e-2, warmup=0).build(20)
    trainer = Trainer(trainer_config, optimizer, lm_loss_for(config), run_id="qlora")
    trainer.add_hook(lambda info: losses.append(info.loss))
    state = trainer.initial_state(lambda key: config.for_training(base))
    before = {  # the step donates the state's buffers: copies
        name: (np.asarray(x.quantized.codes.array), np.asarray(x.quantized.scales.array))
        for name, x in adapter_layers(state.model).items()
    }
    tokens = np.tile(np.arange(VOCAB, dtype=np.int32), 40)
    loader = BatchLoader(TokenWindows(tokens, BASE.seq_len), 4, seed=0)
    final = trainer.train(state, loader.iter_from(0, 0, 1))
    assert losses[-1] < 0.7 * losses[0], losses
    for name, layer in adapter_layers(final.state.model).items():
        codes, scales = before[name]
        np.testing.assert_array_equal(np.asarray(layer.quantized.codes.array), codes)
        np.testing.assert_array_equal(np.asarray(layer.quantized.scales.array), scales)
        assert np.abs(np.asarray(layer.lora_b.array)).max() > 0  # the adapters did train
    # the run's last checkpoint holds the codes (uint8) and resumes from them
    resumed = Trainer(trainer_config, optimizer, lm_loss_for(config), run_id="qlora")
    again = resumed.initial_state(lambda key: config.for_training(base))
    assert int(again.step) == 20
    for name, layer in adapter_layers(again.model).items():
        assert layer.quantized.codes.array.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(layer.quantized.codes.array), before[name][0])
    print("QLoRA nf4 losses:", [round(x, 3) for x in losses])
