"""The Llama configs under config/ parse, the 8B one has Llama 3.1 8B's exact size, and each
family's tiny config is of its family."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomax.config import parse_config
from loomax.lm import TrainLmConfig
from loomax.models import LlamaConfig, LmConfig


@pytest.mark.parametrize("name", ["llama_tiny", "llama_150m", "llama_1b", "llama_8b"])
def test_llama_configs_parse(repo_root, name):
    config = parse_config(TrainLmConfig, repo_root / "config" / f"{name}.yaml")
    assert isinstance(config.model, LlamaConfig)


NOT_A_FAMILY = {"moe_tiny.yaml": "mixtral", "sft_tiny.yaml": "llama", "dpo_tiny.yaml": "llama",
               "rl_tiny.yaml": "llama"}  # fmt: skip
"""Tiny configs named for what they show, not for their ``model.type``."""


def _run_class(path: str) -> type:
    """The run config class a shipped config is for (``loomax dpo``'s, ``loomax rl``'s, or
    ``loomax train``'s)."""
    from loomax.dpo.config import TrainDpoConfig
    from loomax.rl.config import TrainRlConfig

    if path.startswith("rl"):
        return TrainRlConfig
    return TrainDpoConfig if path.startswith("dpo") else TrainLmConfig


@pytest.mark.parametrize(
    "path", sorted(p.name for p in (Path(__file__).parents[2] / "config").glob("*_tiny.yaml"))
)
def test_tiny_configs_are_of_their_family(repo_root, path):
    """config/<type>_tiny.yaml (one per family that ships one) parses as that ``model.type``."""
    config = parse_config(_run_class(path), repo_root / "config" / path)
    family = NOT_A_FAMILY.get(path, path.removesuffix("_tiny.yaml"))
    assert LmConfig.get_choice_name(type(config.model)) == family


def test_llama_8b_parameter_count(repo_root):
    model = parse_config(TrainLmConfig, repo_root / "config" / "llama_8b.yaml").model
    assert model.param_count(model.vocab_size) == 8_030_261_248


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_unrolled_layer_loop_computes_the_same(family):
    """``scan_unroll`` changes the program, not the model: same parameters, same logits."""
    import equinox as eqx
    import haliax as hax
    import jax
    import numpy as np

    from loomax.models import Gpt2Config, LlamaConfig

    def build(unroll):
        shape = dict(seq_len=16, hidden_dim=32, num_layers=4, num_heads=4, scan_unroll=unroll)
        if family == "gpt2":
            return Gpt2Config(**shape).build(50, key=jax.random.PRNGKey(0))
        return LlamaConfig(intermediate_dim=64, num_kv_heads=2, **shape).build(
            50, key=jax.random.PRNGKey(0)
        )

    ids = hax.named(
        jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 50), ("batch", "position")
    )
    logits = eqx.filter_jit(lambda m: m.logits(ids).array)
    want = logits(build(1))
    for unroll in (True, 2):
        model = build(unroll)
        shapes = [x.shape for x in jax.tree.leaves(model)]  # the same arrays: checkpoints fit both
        assert shapes == [x.shape for x in jax.tree.leaves(build(1))]
        np.testing.assert_allclose(logits(model), want, rtol=1e-5, atol=1e-5, err_msg=str(unroll))


def test_scan_unroll_must_be_positive():
    from loomax.models import Gpt2Config

    with pytest.raises(ValueError, match="model.scan_unroll"):
        Gpt2Config(scan_unroll=0)
