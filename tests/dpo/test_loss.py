"""The preference losses and TRL's metrics: equal to TRL's DPOTrainer on the same log-probs,
and the sequence log-probs sum the response tokens' next-token log-probs only."""

from __future__ import annotations

import collections
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.dpo.config import DpoConfig
from loomax.dpo.loss import dpo_loss, preference_loss, preference_metrics, sequence_logps
from loomax.models import LlamaConfig


def _trl_compute_loss():
    """TRL's own ``DPOTrainer._compute_loss``, compiled from TRL's installed source file with
    the names it uses on this path (torch, ``F``, math): importing the module would import
    transformers' ``Trainer`` (~20 s on two busy cores) for a method that needs none of it."""
    import ast
    import importlib.util

    import torch
    import torch.nn.functional as F  # noqa: N812

    spec = importlib.util.find_spec("trl.trainer.dpo_trainer")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DPOTrainer")
    method = next(n for n in trainer.body if getattr(n, "name", None) == "_compute_loss")
    namespace = {"torch": torch, "F": F, "math": math, "warnings": None}
    exec(compile(ast.Module([method], type_ignores=[]), spec.origin, "exec"), namespace)
    return namespace["_compute_loss"]


def _trl_loss_and_metrics(per_token, completion_mask, ref_chosen, ref_rejected, loss, beta):
    """TRL's ``DPOTrainer._compute_loss`` run on given per-token log-probs: the model is a
    stand-in returning them (what TRL's fused head returns), the trainer a namespace with
    the attributes the method reads; nothing is downloaded or built."""
    import torch

    compute_loss = _trl_compute_loss()
    rows, length = completion_mask.shape
    shifted = torch.tensor(completion_mask[:, 1:])
    log_probs = torch.tensor(per_token) * shifted  # TRL's labels mask prompt tokens (-100 -> 0)
    outputs = SimpleNamespace(
        log_probs=log_probs,
        entropy=torch.zeros(rows, length - 1),
        mean_logits=torch.zeros(rows, length - 1),
        is_top1=torch.zeros(rows, length - 1, dtype=torch.bool),
    )
    identity = lambda x: x  # noqa: E731 - one process: gathering changes nothing
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device="cpu", gather=identity, gather_for_metrics=identity),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss],
        loss_weights=[1.0],
        beta=beta,
        use_weighting=False,
        label_smoothing=0.0,
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(rows, length, dtype=torch.long),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "completion_mask": torch.tensor(completion_mask, dtype=torch.long),
        "ref_chosen_logps": torch.tensor(ref_chosen),
        "ref_rejected_logps": torch.tensor(ref_rejected),
    }
    value = compute_loss(fake, lambda **kw: outputs, inputs, False)
    return float(value), {k: v[0] for k, v in fake._metrics["train"].items()}


@pytest.mark.slow  # torch's import (~3 s)
@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_loss_and_metrics_equal_trl_on_the_same_logps(loss, require_extra):
    require_extra("torch", "comparing the DPO loss with TRL's")
    require_extra("trl", "comparing the DPO loss with TRL's")
    rng = np.random.default_rng(0)
    pairs, length, beta = 6, 12, 0.2
    per_token = rng.normal(-2.0, 1.0, (2 * pairs, length - 1)).astype(np.float32)
    completion = np.zeros((2 * pairs, length), np.float32)
    for i in range(2 * pairs):  # prompts and responses of different lengths
        start, end = rng.integers(2, 6), rng.integers(7, length + 1)
        completion[i, start:end] = 1.0
    ref_chosen = rng.normal(-20, 3, pairs).astype(np.float32)
    ref_rejected = rng.normal(-20, 3, pairs).astype(np.float32)
    trl_loss, trl = _trl_loss_and_metrics(
        per_token, completion, ref_chosen, ref_rejected, loss, beta
    )

    logps = (per_token * completion[:, 1:]).sum(axis=1)
    counts = completion.sum(axis=1)
    per_pair, chosen_r, rejected_r = preference_loss(
        logps[:pairs], logps[pairs:], ref_chosen, ref_rejected, counts[:pairs], counts[pairs:],
        loss=loss, beta=beta,
    )  # fmt: skip
    ours = preference_metrics(chosen_r, rejected_r, logps[:pairs], logps[pairs:], jnp.ones(pairs))
    np.testing.assert_allclose(float(jnp.mean(per_pair)), trl_loss, rtol=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected"):  # fmt: skip
        total, count = ours[f"dpo/{name}"]
        np.testing.assert_allclose(float(total / count), trl[name], rtol=1e-5, atol=1e-6)
    assert 0.0 < trl["rewards/accuracies"] < 1.0  # the data tells right from wrong


def test_simpo_is_the_length_normalised_margin_without_a_reference():
    beta, ratio = 2.0, 0.5
    loss, chosen_r, rejected_r = preference_loss(
        jnp.array([-6.0]), jnp.array([-12.0]), jnp.array([99.0]), jnp.array([-99.0]),
        jnp.array([3.0]), jnp.array([4.0]), loss="simpo", beta=beta, simpo_gamma_beta_ratio=ratio,
    )  # fmt: skip
    margin = beta * (-6 / 3 - -12 / 4) - ratio * beta  # the references play no part
    assert float(loss[0]) == pytest.approx(math.log1p(math.exp(-margin)), rel=1e-6)
    assert (float(chosen_r[0]), float(rejected_r[0])) == pytest.approx((beta * -2, beta * -3))


@pytest.mark.slow  # a tiny Llama compiled on CPU (~3 s)
def test_sequence_logps_sum_the_masked_next_token_logps_and_the_loss_reports_dpo_metrics():
    config = LlamaConfig(seq_len=8, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2)  # fmt: skip
    model = config.build(40, key=jax.random.PRNGKey(0))
    tokens = jnp.array([[0, 5, 6, 7, 8, 9, 0, 0], [0, 5, 6, 11, 12, 0, 0, 0]], jnp.int32)
    mask = jnp.array([[0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]], jnp.float32)
    import haliax as hax

    from loomax.models.axes import Batch, Position

    logits = model.logits(hax.named(tokens, (Batch, Position))).array
    logp = jax.nn.log_softmax(logits, axis=-1)
    expected = [
        sum(float(logp[r, t, tokens[r, t + 1]]) for t in range(7) if mask[r, t]) for r in range(2)
    ]
    np.testing.assert_allclose(np.asarray(sequence_logps(model, tokens, mask)), expected, rtol=1e-5)

    batch = {  # pair 0: chosen row 0, rejected row 1; pair 1 is padding (valid 0)
        "chosen": tokens[:1].repeat(2, 0), "chosen_mask": mask[:1].repeat(2, 0),
        "rejected": tokens[1:].repeat(2, 0), "rejected_mask": mask[1:].repeat(2, 0),
        "ref_chosen": jnp.array([expected[0], 0.0]), "ref_rejected": jnp.array([expected[1], 0.0]),
        "valid": jnp.array([1.0, 0.0]),
    }  # fmt: skip
    (total, weight), metrics = dpo_loss(DpoConfig(beta=0.5))(model, batch)
    assert float(weight) == 1.0
    assert float(total) == pytest.approx(math.log(2.0), rel=1e-5)  # policy == reference
    assert {k for k in metrics} >= {
        f"dpo/rewards/{k}" for k in ("chosen", "rejected", "margins", "accuracies")
    }
    assert float(metrics["dpo/rewards/margins"][0]) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.slow  # a tiny LoRA Llama compiled on CPU
def test_a_lora_runs_reference_is_its_base_with_the_adapters_off():
    """``dpo.reference: adapters_off``: the reference log-probs are the policy's own base's,
    in the step (no second copy): the loss, metrics and adapter gradients equal those from
    the base's log-probs given as cached columns; the base gets no gradient through it."""
    import dataclasses

    import equinox as eqx
    import haliax as hax

    from loomax.dpo.config import TrainDpoConfig
    from loomax.models.lora.config import LoraConfig
    from loomax.models.lora.linear import LoraLinear, without_adapters
    from loomax.train.step import trainable_mask

    config = LlamaConfig(
        seq_len=8, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2,
        lora=LoraConfig(rank=4),
    )  # fmt: skip
    model = config.for_training(config.build(40, key=jax.random.PRNGKey(0)))

    def trained(layer):  # B away from 0: the policy is no longer its base
        b = hax.random.normal(jax.random.PRNGKey(1), layer.lora_b.axes) * 0.1
        return eqx.tree_at(lambda m: m.lora_b, layer, b)

    is_lora = lambda x: isinstance(x, LoraLinear)  # noqa: E731
    model = jax.tree.map(lambda n: trained(n) if is_lora(n) else n, model, is_leaf=is_lora)
    tokens = jnp.array([[0, 5, 6, 7, 8, 9, 0, 0], [0, 5, 6, 11, 12, 0, 0, 0]], jnp.int32)
    mask = jnp.array([[0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]], jnp.float32)
    batch = {
        "chosen": tokens[:1], "chosen_mask": mask[:1], "rejected": tokens[1:],
        "rejected_mask": mask[1:], "valid": jnp.array([1.0]),
    }  # fmt: skip
    base = without_adapters(model)
    cached = {
        **batch,
        "ref_chosen": sequence_logps(base, tokens[:1], mask[:1]),
        "ref_rejected": sequence_logps(base, tokens[1:], mask[1:]),
    }
    off = dpo_loss(DpoConfig(reference="adapters_off"))
    assert not off.uses_reference  # no reference columns in its batches
    mask_tree = trainable_mask(model, config.lora.freeze_patterns())

    def run(loss_fn, batch):
        trainable, frozen = eqx.partition(model, mask_tree)

        def total(t):
            (s, n), metrics = loss_fn(eqx.combine(t, frozen), batch)
            return s / n, metrics

        return jax.value_and_grad(total, has_aux=True)(trainable)

    (loss_off, m_off), g_off = run(off, batch)
    (loss_cached, m_cached), g_cached = run(dpo_loss(DpoConfig()), cached)
    assert float(loss_off) == pytest.approx(float(loss_cached), rel=1e-6)
    assert abs(float(m_off["dpo/rewards/margins"][0])) > 1e-4  # the adapters moved it
    for name in m_off:
        assert float(m_off[name][0]) == pytest.approx(float(m_cached[name][0]), rel=1e-5, abs=1e-7)
    for a, b in zip(jax.tree.leaves(g_off), jax.tree.leaves(g_cached), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # a run asking for it without adapters is refused, naming the keys
    with pytest.raises(Exception, match="dpo.reference adapters_off .* model.lora"):
        TrainDpoConfig(
            dpo=DpoConfig(reference="adapters_off"), model=dataclasses.replace(config, lora=None)
        )
    frozen = TrainDpoConfig(dpo=DpoConfig(reference="adapters_off"), model=config)
    assert frozen.trainer.freeze == config.lora.freeze_patterns()  # the base frozen, as in train
