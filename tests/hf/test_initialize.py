"""trainer.initialize_from_hf: a run starts from the weights of a Hugging Face checkpoint directory."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from loomax.hf import export_hf
from loomax.hooks import EmaHook
from loomax.lm import TrainLmConfig, check_initial_weights, initial_model, initial_weights
from loomax.models import LlamaConfig
from loomax.optim import AdamConfig
from loomax.train import Trainer, TrainerConfig

MODEL = LlamaConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
)


def test_run_starts_from_hf_weights(tmp_path):
    source = MODEL.build(50, key=jax.random.PRNGKey(7))
    export_hf(source, tmp_path / "hf")
    trainer_config = TrainerConfig(
        num_train_steps=2, train_batch_size=2, initialize_from_hf=str(tmp_path / "hf"), mp="f32"
    )
    config = TrainLmConfig(model=MODEL, trainer=trainer_config)
    trainer = Trainer(
        trainer_config,
        AdamConfig().build(2),
        lambda m, b, key=None: (0.0, 1.0),
        run_dir=tmp_path / "run",
    )
    trainer.add_hook(EmaHook(decay=0.9))  # extras made from the loaded weights, not the random ones
    state = trainer.initial_state(
        initial_model(config, 50), initial_weights=initial_weights(config, 50)
    )
    assert int(state.step) == 0
    for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(source), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(state.extras["ema"]), jax.tree.leaves(source), strict=True):
        np.testing.assert_array_equal(a, b)
    trainer.finish()


def test_a_resumed_run_does_not_read_the_hf_weights(tmp_path):
    export_hf(MODEL.build(50, key=jax.random.PRNGKey(7)), tmp_path / "hf")
    trainer_config = TrainerConfig(
        num_train_steps=2, train_batch_size=2, initialize_from_hf=str(tmp_path / "hf")
    )
    config = TrainLmConfig(model=MODEL, trainer=trainer_config)

    def make_trainer():
        return Trainer(
            trainer_config,
            AdamConfig().build(2),
            lambda m, b, key=None: (0.0, 1.0),
            run_dir=tmp_path / "run",
        )

    first = make_trainer()
    state = first.initial_state(
        initial_model(config, 50), initial_weights=initial_weights(config, 50)
    )
    first.checkpointer.save(0, state, {}, permanent=True)
    first.finish()
    reads = []
    second = make_trainer()
    second.initial_state(initial_model(config, 50), initial_weights=lambda: reads.append(1))
    assert second.restored_from is not None and reads == []
    second.finish()


def test_vocab_mismatch_and_conflicting_keys_are_named(tmp_path):
    export_hf(MODEL.build(50, key=jax.random.PRNGKey(7)), tmp_path)
    config = TrainLmConfig(model=MODEL, trainer=TrainerConfig(initialize_from_hf=str(tmp_path)))
    with pytest.raises(ValueError, match="initialize_from_hf.*vocabulary of 50"):
        initial_weights(config, 64)()
    with pytest.raises(ValueError, match="initialize_from or trainer.initialize_from_hf"):
        TrainerConfig(initialize_from="x", initialize_from_hf="y")


def test_a_checkpoint_that_cannot_load_is_named_without_reading_weights(tmp_path):
    def check(path, model=MODEL):
        check_initial_weights(
            TrainLmConfig(model=model, trainer=TrainerConfig(initialize_from_hf=str(path)))
        )

    with pytest.raises(FileNotFoundError, match="initialize_from_hf: .*nowhere.*no config.json"):
        check(tmp_path / "nowhere")
    export_hf(MODEL.build(50, key=jax.random.PRNGKey(7)), tmp_path / "hf")
    check(tmp_path / "hf")  # loadable: no error
    wider = LlamaConfig(**{**MODEL.__dict__, "hidden_dim": 64})
    with pytest.raises(
        ValueError,
        match=r"initialize_from_hf: .*does not match .*hidden_size \(model.hidden_dim\): 32 in config.json, 64 configured",
    ):
        check(tmp_path / "hf", wider)
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="initialize_from_hf: .*no model.safetensors"):
        check(tmp_path / "hf")
