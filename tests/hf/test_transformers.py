"""Against transformers itself (torch CPU): exports load with the same logits, and models saved
by transformers import with them. Runs where transformers and torch are installed (not in CI,
where ``hf_reference`` is the oracle); skipped elsewhere."""

from __future__ import annotations

import haliax as hax
import jax
import numpy as np
import pytest

from loomax.hf import export_hf, load_hf
from loomax.models import LlamaConfig
from loomax.models.rotary import LinearRotary, YarnRotary

from .test_convert import CASES, VOCAB, randomized

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ALL = {
    **CASES,
    "llama-mqa-yarn": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=1, rope=YarnRotary(factor=4.0, original_max_position_embeddings=8),
    ),
    "llama-linear": LlamaConfig(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        rope=LinearRotary(factor=2.0),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ALL)
def test_transformers_loads_the_export_with_the_same_logits(tmp_path, case):
    model = randomized(ALL[case])
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == (
        "GPT2LMHeadModel" if case.startswith("gpt2") else "LlamaForCausalLM"
    )
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (32,), 0, VOCAB))
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    got = np.asarray(model.logits(hax.named(ids, "position")).array)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4
    ),
    "llama-gqa": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", HF_CONFIGS)
def test_a_model_saved_by_transformers_imports_with_the_same_logits(tmp_path, case):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[case]()).eval()
    with torch.no_grad():  # move every weight off its initial value (norm scales too)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (32,), 0, VOCAB))
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    got = np.asarray(model.logits(hax.named(ids, "position")).array)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
