"""``loomax dpo``'s config: with trainer.initialize_from_hf, the policy's model is the
checkpoint's (family and shape from its config.json), as for ``loomax train``."""

from __future__ import annotations

import jax
import pytest

from loomax.dpo.command import dpo_config
from loomax.hf import export_hf
from loomax.models import LlamaConfig


@pytest.mark.slow  # a tiny model built and exported (~3 s)
def test_the_policy_model_comes_from_the_hf_checkpoint(tmp_path):
    small = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)  # fmt: skip
    export_hf(small.build(50, key=jax.random.PRNGKey(0)), tmp_path / "hf")
    config = dpo_config(
        None, ["--trainer.initialize_from_hf", str(tmp_path / "hf"), "--model.seq_len", "24"]
    )
    assert isinstance(config.model, LlamaConfig)  # the default section is gpt2
    assert (config.model.hidden_dim, config.model.num_layers, config.model.num_kv_heads) == (
        32,
        2,
        2,
    )
    assert config.model.seq_len == 24  # the run's own model keys win
