"""Granite (``model.type: granite``) beyond the contract suites.

The suites over every family already check granite at its defaults (Granite 3.0's
multipliers: training, save/load, KV-cache decoding, the numpy reference, transformers both
ways). Here: a model built by transformers with other multipliers imports with its logits,
each multiplier changes the logits, and multipliers of 1 are Llama exactly.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.hf import export_hf, load_hf
from loomax.models import LlamaConfig, LmConfig

VOCAB = 37
Granite = LmConfig.get_choice_class("granite")
TINY = dict(seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)  # fmt: skip
ODD = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.7, logits_scaling=0.25)  # fmt: skip
IDS = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (16,), 0, VOCAB))


def logits(model) -> np.ndarray:
    return np.asarray(model.logits(hax.named(IDS, "position")).array)


def test_transformers_granite_imports_with_its_logits_and_exports_back(tmp_path):
    """GraniteForCausalLM with random weights and multipliers far from 1 (the logits divided
    by 0.25, so larger): ours from its save equal its logits, and our export loads back in it."""
    import torch
    import transformers

    hf_config = transformers.GraniteConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, **ODD,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GraniteForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.5)
        want = hf(torch.tensor(IDS[None], dtype=torch.long)).logits[0].numpy()
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert type(model.config) is Granite
    assert {k: getattr(model.config, k) for k in ODD} == ODD
    got = logits(model)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).std() > 1.0  # the multipliers matter at this scale

    export_hf(model, tmp_path / "ours", special_tokens={"eos_token_id": 0})
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    with torch.no_grad():
        again = back.eval()(torch.tensor(IDS[None], dtype=torch.long)).logits[0].numpy()
    np.testing.assert_allclose(again, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ODD))
def test_each_multiplier_changes_the_logits(name):
    """The same weights (the multipliers do not change the initialisation), other logits."""
    model = Granite(**TINY).build(VOCAB, key=jax.random.PRNGKey(0))
    other = Granite(**TINY, **{name: ODD[name]}).build(VOCAB, key=jax.random.PRNGKey(0))
    weights = [jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (model, other)]
    assert all(np.array_equal(a, b) for a, b in zip(*weights, strict=True))
    assert not np.allclose(logits(model), logits(other), atol=1e-6)


def test_multipliers_of_one_are_llama_exactly():
    ones = {k: 1.0 for k in ODD} | {"attention_multiplier": 0.5}  # 1 / sqrt(head_dim 4)
    granite = Granite(**TINY, **ones).build(VOCAB, key=jax.random.PRNGKey(0))
    llama = LlamaConfig(**TINY).build(VOCAB, key=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(logits(granite), logits(llama))


def test_multipliers_travel_in_config_json_and_zero_scaling_is_refused():
    config = Granite(**TINY, head_dim=4, **ODD)  # import spells head_dim out
    hf = config.hf_config(VOCAB)
    assert hf["model_type"] == "granite" and {k: hf[k] for k in ODD} == ODD
    assert Granite.from_hf_config(hf) == config
    plain = {k: v for k, v in hf.items() if k not in ODD}  # transformers' defaults: 1
    assert {k: getattr(Granite.from_hf_config(plain), k) for k in ODD} == dict.fromkeys(ODD, 1.0)
    with pytest.raises(ConfigError, match="logits_scaling"):
        Granite(**TINY, logits_scaling=0.0)
