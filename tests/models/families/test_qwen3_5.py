"""Dense Qwen3.5's text model (``model.type: qwen3_5_text``): a model transformers built
(random weights, a linear and a full layer, a SwiGLU MLP each) imports with its logits (f32,
1e-5) and greedy tokens and exports back tensor for tensor. The export direction and the
contract are the suites over every family (tests/hf/test_transformers.py,
tests/models/test_contract.py)."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import numpy as np

from loomax.hf import export_hf, load_hf
from loomax.models.decoding.generate import sample_tokens

VOCAB = 37
IDS = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (16,), 0, VOCAB))
PROMPT = [3, 1, 4, 1, 5]


def test_a_model_transformers_built_imports_with_its_logits_tokens_and_tensors(tmp_path, families):
    import torch
    import transformers
    from safetensors.numpy import load_file

    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=16,
    )  # fmt: skip
    hf = families.noisy_hf_model(config, 0.5)
    hf.save_pretrained(tmp_path / "theirs")
    loaded = load_hf(tmp_path / "theirs")
    assert type(loaded.config).__name__ == "Qwen35Config" and not loaded.config.has_experts
    got = eqx.filter_jit(lambda m: m.logits(hax.named(IDS, "position")).array)(loaded)
    with torch.no_grad():
        want = hf(torch.tensor(IDS[None], dtype=torch.long)).logits[0].numpy()
        theirs = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0, min_new_tokens=8,
        )[0].tolist()  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    key = jax.random.PRNGKey(0)
    assert sample_tokens(loaded, PROMPT, seq_len=16, max_new_tokens=8, temperature=0.0, key=key) == theirs  # fmt: skip
    export_hf(loaded, tmp_path / "back")
    a, b = load_file(tmp_path / "theirs/model.safetensors"), load_file(tmp_path / "back/model.safetensors")  # fmt: skip
    assert sorted(a) == sorted(b) and "model.layers.0.mlp.up_proj.weight" in b
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
