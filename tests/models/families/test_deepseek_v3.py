"""DeepSeek-V3 (``model.type: deepseek_v3``): issue 64's goal, a tiny model trained a few
steps by the real train step (its routing bias moved by the aux-loss-free update) exports to
transformers' ``DeepseekV3ForCausalLM`` with the same logits (f32, 1e-5) and the same greedy
tokens as decoding over MLA's latent cache here; the shipped tiny config parses with
moe_tiny's width and active MLP width; export refuses what the HF class lacks."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

from loomax.config import ConfigError, parse_config
from loomax.hf import export_hf
from loomax.lm import TrainLmConfig, lm_loss
from loomax.models.decoding.generate import sample_tokens
from loomax.models.families.deepseek_v3 import DeepseekV3Config
from loomax.train.state import TrainerState
from loomax.train.step import make_train_step, trainable_params

VOCAB, SEQ, STEPS = 64, 32, 12
PATTERN = np.tile([3, 1, 4, 1, 5, 9, 2, 6, 7], 4)[:SEQ]
KEY = jax.random.PRNGKey(0)


@pytest.fixture(scope="module")
def tiny(families) -> DeepseekV3Config:
    config = families.tiny_config("deepseek_v3", seq_len=SEQ)
    moe = dataclasses.replace(config.moe, bias_update_rate=0.01)
    return dataclasses.replace(config, moe=moe)


@pytest.fixture(scope="module")
def trained(tiny):
    """``(model, losses)`` after STEPS Adam steps of the real train step on a repeating
    sequence (two rows, shifted)."""
    model = tiny.build(VOCAB, key=KEY)
    optimizer = optax.adam(3e-2)
    params = trainable_params(model)  # the routing bias is a buffer: not trained
    state = TrainerState(jnp.zeros((), jnp.int32), model, optimizer.init(params), KEY)
    step = jax.jit(make_train_step(lm_loss(block_size=16), optimizer, mp=jmp.get_policy("f32")))
    batch = jnp.asarray(np.stack([PATTERN, np.roll(PATTERN, 2)]))
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["train/loss"]))
    return state.model, losses


def test_a_trained_model_gives_transformers_its_logits_and_greedy_tokens(trained, tmp_path):
    import torch
    import transformers

    model, losses = trained
    assert losses[-1] < losses[0] / 2, losses
    bias = model.blocks.stacked.mlp.bias.value.array
    assert float(jnp.max(jnp.abs(bias))) > 0  # the aux-loss-free update moved it
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        want = hf(torch.tensor(PATTERN[None], dtype=torch.long)).logits[0].numpy()
        theirs = hf.generate(
            torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=12, min_new_tokens=12,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0].tolist()  # fmt: skip
    forward = eqx.filter_jit(lambda m: m.logits(hax.named(PATTERN, "position")).array)
    got = np.asarray(forward(model))  # one program (op by op: MLA and the experts, ~2.5x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    prompt = [3, 1, 4, 1, 5]
    ours = sample_tokens(model, prompt, seq_len=SEQ, max_new_tokens=12, temperature=0.0, key=KEY)
    assert ours[5] == 9  # it learned the sequence's next token
    assert ours == theirs


def test_export_refuses_what_the_hf_class_lacks(tiny):
    no_bias = dataclasses.replace(tiny.moe, routing_bias=False, bias_update_rate=0.0)
    with pytest.raises(ConfigError, match="model.moe.routing_bias"):
        dataclasses.replace(tiny, moe=no_bias).hf_config(VOCAB)
    softmax = dataclasses.replace(tiny.moe, score_function="softmax")
    with pytest.raises(ConfigError, match="model.moe.score_function"):
        dataclasses.replace(tiny, moe=softmax).hf_config(VOCAB)


def test_unsupported_options_are_refused_naming_the_key(tiny):
    for key in ("qk_norm", "use_bias", "input_embedding_norm"):
        with pytest.raises(ConfigError, match=f"model.{key}"):
            dataclasses.replace(tiny, **{key: True})


def test_the_tiny_config_has_moe_tinys_width_and_active_mlp(repo_root):
    config = parse_config(TrainLmConfig, repo_root / "config" / "deepseek_v3_tiny.yaml").model
    moe_tiny = parse_config(TrainLmConfig, repo_root / "config" / "moe_tiny.yaml").model
    assert isinstance(config, DeepseekV3Config) and config.moe.num_groups > 1
    active = config.expert_dim * (config.moe.num_experts_per_tok + config.moe.num_shared_experts)
    moe_active = moe_tiny.expert_dim * moe_tiny.moe.num_experts_per_tok
    assert active == moe_active == config.intermediate_dim
    assert (config.hidden_dim, config.num_layers) == (moe_tiny.hidden_dim, moe_tiny.num_layers)
