"""gpt-oss (``model.type: gpt_oss``) beyond the contract suites (which check its tiny shape's
export and import against transformers): trained a few steps, our export gives
transformers' greedy tokens past the window; a model transformers built (random sinks,
biases, a clamp low enough to bite, YaRN as gpt-oss has it) imports with its logits and
greedy tokens; YaRN without truncation is transformers'; the fused gate/up tensor's
interleaving; and what import refuses."""

from __future__ import annotations

import dataclasses

import haliax as hax
import jax
import numpy as np
import pytest

from loomax.errors import BadFileError
from loomax.hf import export_hf, load_hf
from loomax.models import LmConfig
from loomax.models.attention.rotary import YarnRotary
from loomax.models.decoding.generate import sample_tokens
from loomax.models.moe.moe import MoeConfig

VOCAB = 37
GptOss = LmConfig.get_choice_class("gpt_oss")
TINY = GptOss(
    seq_len=16, hidden_dim=16, intermediate_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, sliding_window=3, rope=YarnRotary(theta=150_000.0, factor=4.0,
    original_max_position_embeddings=8, truncate=False),
    moe=MoeConfig(num_experts=4, num_experts_per_tok=2, expert_bias=True, swiglu_limit=7.0),
)  # fmt: skip
KEY = jax.random.PRNGKey(0)
IDS = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (16,), 0, VOCAB))
PROMPT = [3, 1, 4, 1, 5]


def logits(model) -> np.ndarray:
    return np.asarray(model.logits(hax.named(IDS, "position")).array)


def hf_logits(torch, hf) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(IDS[None], dtype=torch.long)).logits[0].numpy()


def hf_greedy(torch, hf, steps: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
            pad_token_id=0, min_new_tokens=steps,
        )[0].tolist()  # fmt: skip


def test_trained_export_gives_transformers_greedy_tokens_past_the_window(tmp_path, families):
    import torch
    import transformers

    model = families.trained(TINY, VOCAB, KEY)
    sinks = model.blocks.stacked.attn.sinks.array
    assert float(np.abs(sinks).max()) > 0.01  # the sinks were trained
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    np.testing.assert_allclose(logits(model), hf_logits(torch, hf), rtol=1e-5, atol=1e-5)
    ours = sample_tokens(model, PROMPT, seq_len=16, max_new_tokens=11, temperature=0.0, key=KEY)
    assert ours[5:7] == [9, 2] and ours == hf_greedy(torch, hf, 11)


def test_a_model_transformers_built_imports_with_its_logits_and_greedy_tokens(tmp_path):
    import torch
    import transformers

    hf_config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        sliding_window=3, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.5 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    loaded = load_hf(tmp_path)
    c = loaded.config
    assert c.rope == YarnRotary(theta=150_000.0, factor=32.0, truncate=False)
    assert (c.layer_windows, c.moe.swiglu_limit, c.moe.expert_bias) == ((3, None), 0.5, True)
    np.testing.assert_allclose(logits(loaded), hf_logits(torch, hf), rtol=1e-5, atol=1e-5)
    ours = sample_tokens(loaded, PROMPT, seq_len=16, max_new_tokens=8, temperature=0.0, key=KEY)
    assert ours == hf_greedy(torch, hf, 8)


def test_yarn_without_truncation_is_transformers():
    import torch  # noqa: F401
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = YarnRotary(theta=150_000.0, factor=32.0, truncate=False)
    for truncate in (False, True):
        hf = transformers.GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=256)
        hf.rope_parameters = {**hf.rope_parameters, "truncate": truncate}
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        ours = dataclasses.replace(rope, truncate=truncate)
        np.testing.assert_allclose(ours.inv_freq(64), inv.numpy(), rtol=1e-6)
        assert ours.attention_factor() == pytest.approx(factor)
    assert not np.allclose(rope.inv_freq(64), dataclasses.replace(rope, truncate=True).inv_freq(64))


def test_gate_and_up_interleave_in_the_fused_tensor(tmp_path):
    from loomax.hf.convert import read_hf

    model = TINY.build(VOCAB, key=KEY)
    export_hf(model, tmp_path)
    _, tensors = read_hf(tmp_path)
    fused = tensors["model.layers.1.mlp.experts.gate_up_proj"]  # [experts, hidden, 2 x width]
    mlp = model.blocks.stacked.mlp
    gate = mlp.gate.rearrange(("layers", "experts", "embed", "mlp")).array[1]
    up = mlp.up.rearrange(("layers", "experts", "embed", "mlp")).array[1]
    np.testing.assert_array_equal(fused[..., ::2], gate)
    np.testing.assert_array_equal(fused[..., 1::2], up)


def test_import_refuses_attention_without_biases():
    hf = dict(TINY.hf_config(VOCAB), attention_bias=False)
    with pytest.raises(BadFileError, match="attention_bias"):
        GptOss.from_hf_config(hf)
