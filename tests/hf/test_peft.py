"""LoRA's PEFT export (loomax.hf.peft) against peft itself (the `test` extra): the base
exported by export_hf, the adapter by export_peft, loaded with PeftModel.from_pretrained
onto the transformers model, give the Loomax model's logits (1e-5 in f32) for a Llama, a
GPT-2 (Conv1D, fan_in_fan_out), a Llama with DoRA (use_dora) and a Mixtral with adapters
on its experts (PEFT's target_parameters); with the adapter off, the base's; gpt-oss's experts are refused by name. Offline: every model is
built here (conftest sets HF_HUB_OFFLINE)."""

from __future__ import annotations

import json

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from loomax.errors import UserError
from loomax.hf.peft import export_base_and_adapter, export_peft
from loomax.models import Gpt2Config, LlamaConfig, MixtralConfig, MoeConfig
from loomax.models.families.phi3 import Phi3Config
from loomax.models.lora.config import LoraConfig
from loomax.models.lora.linear import LoraLinear, without_adapters
from loomax.models.moe.expert_adapter import ExpertAdapter

VOCAB = 61
CASES = {
    "llama": LlamaConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=2, lora=LoraConfig(rank=4, alpha=8.0),
    ),
    "gpt2": Gpt2Config(
        seq_len=16, hidden_dim=32, num_layers=2, num_heads=4,
        lora=LoraConfig(targets=("attn.qkv", "mlp"), rank=2, alpha=3.0),
    ),
    # DoRA: the magnitudes as PEFT's lora_magnitude_vector, use_dora
    "llama_dora": LlamaConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=2, lora=LoraConfig(targets=("attn", "mlp"), rank=4, alpha=8.0, dora=True),
    ),
    # LoRA on the experts: PEFT target_parameters on transformers' fused expert tensors
    "mixtral": MixtralConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=2, num_heads=4,
        num_kv_heads=2, moe=MoeConfig(num_experts=4, num_experts_per_tok=2),
        lora=LoraConfig(targets=("attn", "mlp"), rank=2, alpha=3.0),
    ),
}  # fmt: skip


def trained(config):
    """A model of ``config`` with adapters whose B is random (as after training)."""
    model = config.for_training(config.build(VOCAB, key=jax.random.PRNGKey(0)))

    def bump(layer):
        b = hax.random.normal(jax.random.PRNGKey(1), layer.lora_b.axes) * 0.1
        layer = eqx.tree_at(lambda m: m.lora_b, layer, b)
        if getattr(layer, "lora_m", None) is None:
            return layer
        m = hax.random.normal(jax.random.PRNGKey(2), layer.lora_m.axes) * 0.2  # DoRA's
        return eqx.tree_at(lambda x: x.lora_m, layer, m)

    is_lora = lambda x: isinstance(x, (LoraLinear, ExpertAdapter))  # noqa: E731
    return jax.tree.map(lambda n: bump(n) if is_lora(n) else n, model, is_leaf=is_lora)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_peft_loads_the_adapter_with_the_same_logits(tmp_path, case, needs_peft):
    import peft
    import torch
    import transformers

    model = trained(CASES[case])
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    export_base_and_adapter(model, base_dir, adapter_dir, special_tokens={"eos_token_id": 0})
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    experts = case == "mixtral"  # the fused gate_up_proj: rank 2r, every adapter padded to it
    assert (config["peft_type"], config["r"], config["base_model_name_or_path"]) == (
        "LORA", CASES[case].lora.rank * (2 if experts else 1), str(base_dir),
    )  # fmt: skip
    assert config["use_dora"] == (case == "llama_dora")
    if experts:
        assert config["target_parameters"] == [
            "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
        ]  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    ids = np.arange(16) % VOCAB
    with torch.no_grad():
        want = tuned(torch.tensor(ids[None])).logits[0].numpy()
        with tuned.disable_adapter():
            base = tuned(torch.tensor(ids[None])).logits[0].numpy()
    named = hax.named(ids, "position")
    got = np.asarray(model.logits(named).array)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    unadapted = np.asarray(without_adapters(model).logits(named).array)
    np.testing.assert_allclose(unadapted, base, rtol=1e-5, atol=1e-5)
    assert np.abs(got - unadapted).max() > 1e-2  # the adapter matters


def test_a_fused_hf_tensor_is_refused_by_name(tmp_path):
    config = Phi3Config(
        seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        lora=LoraConfig(targets=("q_proj",), rank=2),
    )  # fmt: skip
    with pytest.raises(UserError, match="q_proj: its HF tensor .*qkv_proj.* is fused"):
        export_peft(trained(config), tmp_path)


def test_expert_adapters_of_an_unsupported_layout_are_refused_by_name(tmp_path, families):
    config = families.tiny_config("gpt_oss", lora=LoraConfig(targets=(r"mlp\.up$",), rank=2))
    with pytest.raises(UserError, match="gpt_oss: its Hugging Face experts .* merge the"):
        export_peft(trained(config), tmp_path)


def test_loomax_export_peft_writes_the_base_and_the_adapter(tmp_path, monkeypatch, capsys):
    """`loomax export --peft DIR`: the checkpoint read with its adapters kept apart, the
    base (no adapters) at --out, the adapter at DIR."""
    import loomax.inference
    from loomax.cli import main
    from loomax.hf import load_hf

    model = trained(CASES["llama"])
    asked = {}

    def load(checkpoint, *, config_path=None, overrides=(), merge_adapters=True):
        asked["merge_adapters"] = merge_adapters
        return loomax.inference.LoadedModel(model, None, None, f"checkpoint {checkpoint}")

    monkeypatch.setattr(loomax.inference, "load_for_inference", load)
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    main(["export", "--checkpoint", "run/checkpoints", "--out", str(base), "--peft", str(adapter)])
    assert asked == {"merge_adapters": False}
    assert "PEFT adapter" in capsys.readouterr().out
    assert (adapter / "adapter_model.safetensors").is_file()
    named = hax.named(np.arange(16) % VOCAB, "position")
    got = np.asarray(load_hf(base).logits(named).array)
    want = np.asarray(without_adapters(model).logits(named).array)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
