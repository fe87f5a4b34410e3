"""Gemma 3 text (``model.type: gemma3_text``) beyond the contract suites.

The suites over every family check gemma3_text at its tiny shape, two layers, where its
pattern of six makes both local. Here, with a global layer beside a local one: our export
loads in transformers with our logits and, trained, greedy tokens, a model transformers built (global
rotary scaled as Gemma 3 4B's) imports with its logits, each layer kind rotates by its own
base, the pattern and rotary of a config.json as the Hub has them (no ``layer_types``), and
what import refuses.
"""

from __future__ import annotations

import dataclasses

import haliax as hax
import jax
import numpy as np
import pytest

from loomax.errors import BadFileError
from loomax.hf import export_hf, load_hf
from loomax.models import LmConfig
from loomax.models.attention.rotary import DefaultRotary, LinearRotary
from loomax.models.decoding.generate import sample_tokens

VOCAB = 37
Gemma3 = LmConfig.get_choice_class("gemma3_text")
MIXED = Gemma3(
    seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, sliding_window=3, sliding_window_pattern=(True, False), query_pre_attn_scalar=8,
)  # fmt: skip
KEY = jax.random.PRNGKey(0)
IDS = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (16,), 0, VOCAB))


def _gemma2_tests():
    """tests/models/families/test_gemma2.py as a module (its ``built``: the same vocabulary)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name("test_gemma2.py")
    spec = importlib.util.spec_from_file_location("loomax_tests_gemma2_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.VOCAB == VOCAB
    return module


built = _gemma2_tests().built
"""Every weight random (norm scales too) and scaled up, as the Gemma 2 tests build them."""


def logits(model) -> np.ndarray:
    return np.asarray(model.logits(hax.named(IDS, "position")).array)


def hf_logits(torch, hf) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(IDS[None], dtype=torch.long)).logits[0].numpy()


def test_a_local_and_a_global_layer_match_transformers_trained_with_greedy_tokens(
    tmp_path, families
):
    """Random weights: our export's logits are transformers'; trained a few steps: transformers'
    greedy ``generate`` gives the tokens ``loomax generate`` (``sample_tokens``) gives."""
    import torch
    import transformers

    model = built(MIXED)
    export_hf(model, tmp_path / "random", special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "random", dtype=torch.float32)
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    assert hf.config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    np.testing.assert_allclose(logits(model), hf_logits(torch, hf.eval()), rtol=1e-5, atol=1e-5)
    model = families.trained(MIXED, VOCAB, KEY)
    export_hf(model, tmp_path / "trained", special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "trained", dtype=torch.float32
    )
    prompt = [3, 1, 4, 1, 5]  # decodes 11 positions past the window of 3
    ours = sample_tokens(model, prompt, seq_len=16, max_new_tokens=11, temperature=0.0, key=KEY)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=11, do_sample=False, eos_token_id=None,
            pad_token_id=0, min_new_tokens=11,
        )[0].tolist()  # fmt: skip
    assert ours[5:7] == [9, 2] and ours == theirs  # it learned the sequence


def test_a_model_transformers_built_with_a_scaled_global_rotary_imports(tmp_path):
    import torch
    import transformers

    hf_config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
        query_pre_attn_scalar=8, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    loaded = load_hf(tmp_path)
    assert loaded.config.rope == LinearRotary(theta=1_000_000.0, factor=8.0)
    assert loaded.config.layer_windows == (3, None)
    np.testing.assert_allclose(logits(loaded), hf_logits(torch, hf), rtol=1e-5, atol=1e-5)


def test_each_layer_kind_rotates_by_its_own_base():
    """The local base moves the logits only through the local layer, the global rotary only
    through the global one: with every layer local, the global rotary changes nothing."""
    base = logits(built(MIXED))
    local = dataclasses.replace(MIXED, rope_local_base_freq=500.0)
    far = dataclasses.replace(MIXED, rope=DefaultRotary(theta=500.0))
    assert not np.allclose(logits(built(local)), base, atol=1e-3)
    assert not np.allclose(logits(built(far)), base, atol=1e-3)
    all_local = dataclasses.replace(MIXED, sliding_window_pattern=(True,))
    assert all_local.layer_ropes == (DefaultRotary(theta=10_000.0),) * 2
    far_local = dataclasses.replace(all_local, rope=DefaultRotary(theta=500.0))
    np.testing.assert_array_equal(logits(built(far_local)), logits(built(all_local)))


def test_a_hub_config_json_without_layer_types_imports_its_pattern_and_ropes():
    """Gemma 3 1B's config.json (as the Hub has it): every sixth layer global, the local base
    and the global rotary in the older fields; export writes the same layers back."""
    hub = {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
        "rope_theta": 1_000_000, "rope_local_base_freq": 10_000, "rope_scaling": None,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    }  # fmt: skip
    config = Gemma3.from_hf_config(hub)
    globals_ = [i for i, w in enumerate(config.layer_windows) if w is None]
    assert globals_ == [5, 11, 17, 23] and set(config.layer_windows) == {512, None}
    assert config.rope == DefaultRotary(theta=1_000_000) and config.qk_norm
    kinds = config.hf_config(262144)["layer_types"]
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == globals_
    assert Gemma3(num_layers=2, sliding_window=4).layer_windows == (4, 4)  # pattern cut to 2
    saved = {**hub, "num_hidden_layers": 6, "_sliding_window_pattern": 3}  # transformers 5's name
    del saved["sliding_window_pattern"]
    assert Gemma3.from_hf_config(saved).layer_windows == (512, 512, None) * 2


@pytest.mark.parametrize(
    "field",
    [
        {"use_bidirectional_attention": True},
        {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
    ],
)
def test_import_refuses_what_it_cannot_run(field):
    hf = dict(MIXED.hf_config(VOCAB), **field)
    with pytest.raises(BadFileError, match=next(iter(field))):
        Gemma3.from_hf_config(hf)
