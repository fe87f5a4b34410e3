"""Tiny configs of every registered model family, for the suites that run over all of them,
and the programs those suites share (``logits``, ``adam_step``: one compile a family and shape).

Nothing here lists families: ``model_types()`` is ``LmConfig``'s registry, and
``tiny_config`` fills a family's own fields from one tiny shape (a family's other fields
keep their defaults), so a new family is in every such suite once it is registered.
Every family is a Hugging Face family (``loomax.hf.family.HfFamily``, in the HF suites)
unless ``NO_HF`` says why not: ``hf_problem`` names what a family lacks, so one missing a
member fails tests/hf/test_convert.py instead of dropping out of the HF suites.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
import optax

from loomax.config_reference import registry_members
from loomax.hf.family import _MEMBERS as HF_MEMBERS
from loomax.hf.family import families as hf_families
from loomax.models import LmConfig, next_token_loss

SHAPE = dict(
    seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2
)  # fmt: skip
"""The tiny shape; each key is used by the families that have that field."""
WINDOWS = dict(sliding_window=6)
"""Tiny windows, for the families whose window is on by default (shorter than the sequence)."""
HYBRID = dict(
    layer_types=("linear_attention", "full_attention"), head_dim=8, linear_key_heads=2,
    linear_value_heads=4, linear_key_dim=8, linear_value_dim=8, linear_chunk=8, expert_dim=16,
    shared_expert_dim=16,
)  # fmt: skip
"""Tiny Gated DeltaNet hybrids, for the families with linear_attention layers (one of each
kind: transformers' generate needs a full-attention layer)."""
NO_REFERENCE: dict[str, str] = {
    "qwen3_next": "Gated DeltaNet layers: held to transformers instead (tests/hf/test_transformers.py)",
    "qwen3_5_moe_text": "Gated DeltaNet layers: held to transformers instead (tests/hf/test_transformers.py)",
    "qwen3_5_text": "Gated DeltaNet layers: held to transformers instead (tests/hf/test_transformers.py)",
    "deepseek_v3": "MLA and DeepSeek routing: held to transformers instead (tests/hf/test_transformers.py)",
}
"""HF families that tests/hf/hf_reference.py's numpy forward does not compute, with the reason."""
SAME_MODEL: dict[str, str] = {"qwen3_5_moe_text": "qwen3_next"}
"""Families whose model is another family's (the same class and parameters from the same
fields; only the HF layout differs): the contract suite computes with it once, as that family."""
EXPERTS = dict(num_experts=4, num_experts_per_tok=2)
"""Tiny mixtures of experts, for the families with a ``moe`` section (their routing kept)."""
GROUPED = dict(num_groups=2, topk_groups=1, first_dense_layers=1, expert_intermediate_dim=16)
"""For the families whose routing is group-limited (DeepSeek-V3): two groups of the tiny
experts, tiny experts, and the first layer dense."""
MLA = dict(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
"""Tiny latent attention, for the families with its fields (DeepSeek-V3)."""


@eqx.filter_jit
def logits(model, tokens: hax.NamedArray) -> hax.NamedArray:
    """``model``'s logits of ``tokens`` [batch, position] as one compiled program. One
    function for the suites of every family (tests/models/test_contract.py, tests/hf): at the
    same family, vocabulary and length they share its compile (in a process; the persistent
    compilation cache between processes)."""
    return model.logits(tokens)


ADAM = optax.adam(3e-2)
"""The optimizer of the family suites' training checks (one object: ``adam_step`` is static in it)."""


@eqx.filter_jit
def adam_step(model, state, batch: hax.NamedArray):
    """One ``ADAM`` step of ``model`` on ``batch`` [batch, position] (the blocked loss, blocks
    of half the length): ``(model, state, loss)``. One function for the suites that train
    every family (tests/models/test_contract.py, tests/hf/test_transformers.py): at the same
    family and shapes they share its compile; the batch is an argument, not a constant."""

    def loss_fn(m):
        total, count = next_token_loss(m, batch, block_size=batch.axis_size("position") // 2)
        return total / count

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, state = ADAM.update(grads, state, model)
    return eqx.apply_updates(model, updates), state, loss


def row_logits(model, ids) -> np.ndarray:
    """``logits`` of the ids ``ids`` [position] (as the two rows of a batch: the contract
    suite's shape): [position, vocab]."""
    both = hax.named(jnp.stack([jnp.asarray(ids, jnp.int32)] * 2), ("batch", "position"))
    return np.asarray(logits(model, both).array[0])


def model_types() -> list[str]:
    """Every built-in ``model.type``."""
    return [name for name, _ in registry_members(LmConfig)]


NO_HF: dict[str, str] = {}
"""Built-in model types with no Hugging Face side, each with the reason (none today): every
other registered type must be an HF family, under its own name (``hf_problem``)."""


def hf_problem(model_type: str) -> str | None:
    """What keeps ``model_type`` out of the HF suites although it is not on ``NO_HF``
    (None if nothing does): no ``hf_model_type`` of its own, another one than its
    ``model.type`` (the HF suites build it by that name), or the ``HfFamily`` members it lacks."""
    if model_type in NO_HF:
        return None
    cls = LmConfig.get_choice_class(model_type)
    where = f"model.type {model_type} ({cls.__module__}.{cls.__qualname__})"
    kind = cls.__dict__.get("hf_model_type")
    if kind is None:
        return f"{where} defines no hf_model_type of its own; define HfFamily or add it to NO_HF"
    missing = [name for name in HF_MEMBERS if not hasattr(cls, name)]
    if missing:
        return f"{where} lacks HfFamily's {', '.join(missing)}"
    if kind != model_type:
        return f"{where} has hf_model_type {kind!r}; the HF suites need {model_type!r}"
    if hf_families().get(kind) is not cls:
        return f"{where} is not loomax.hf.family.families()[{kind!r}]"
    return None


def tiny_config(model_type: str, **overrides) -> LmConfig:
    """A tiny config of ``model_type``: ``SHAPE`` where the family has the field, then ``overrides``."""
    cls = LmConfig.get_choice_class(model_type)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    shape = {k: v for k, v in SHAPE.items() if k in defaults}
    shape |= {k: v for k, v in WINDOWS.items() if defaults.get(k) is not None}
    shape |= {k: v for k, v in MLA.items() if k in defaults}
    if "linear_attention" in (defaults.get("layer_types") or ()):
        shape |= HYBRID
    if "moe" in defaults:  # the family's routing, with few experts
        grouped = GROUPED if cls().moe.num_groups > 1 else {}
        shape["moe"] = dataclasses.replace(cls().moe, **EXPERTS, **grouped)
    return cls(**{**shape, **overrides})


def trained(config: LmConfig, vocab: int, key, steps: int = 12):
    """``config``'s model trained ``steps`` Adam steps on a repeating sequence (the blocked
    loss); its loss must halve. The family tests export it and compare transformers' greedy
    tokens against ours."""
    model = config.build(vocab, key=key)
    pattern = np.tile([3, 1, 4, 1, 5, 9, 2, 6, 7], 2)[:16]
    batch = hax.named(np.stack([pattern, np.roll(pattern, 2)]), ("batch", "position"))
    state, losses = ADAM.init(eqx.filter(model, eqx.is_inexact_array)), []
    for _ in range(steps):
        model, state, loss = adam_step(model, state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] / 2, losses
    return model


def noisy_hf_model(hf_config, scale: float):
    """transformers' model of ``hf_config`` (torch seed 0, eval mode), every parameter moved by
    ``scale`` times a standard normal draw: no weight left at its init's zeros or ones."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(scale * torch.randn_like(p))
    return hf


def jit_logits(model, ids):
    """Our logits [position, vocab] of one row of token ids, as one compiled forward."""
    import equinox as eqx
    import haliax as hax
    import numpy as np

    return np.asarray(eqx.filter_jit(lambda m: m.logits(hax.named(ids, "position")).array)(model))


def hf_logits(hf, ids):
    """transformers' logits [position, vocab] of one row of token ids."""
    import numpy as np
    import torch

    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids)[None], dtype=torch.long)).logits[0].numpy()


def hf_greedy(hf, prompt, steps: int) -> list[int]:
    """``prompt`` and exactly ``steps`` greedy tokens of transformers' ``generate``."""
    import torch

    with torch.no_grad():
        return hf.generate(
            torch.tensor([list(prompt)]), max_new_tokens=steps, do_sample=False,
            eos_token_id=None, pad_token_id=0, min_new_tokens=steps,
        )[0].tolist()  # fmt: skip
