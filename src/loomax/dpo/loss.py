"""Sequence log-probs over response tokens, and the preference losses with TRL's metrics.

``preference_loss`` works on per-pair sequence log-probs alone (policy and reference,
chosen and rejected), so that it can be checked against TRL's ``DPOTrainer`` on the same
numbers. The rewards are TRL's: ``β · (log π(y) − log π_ref(y))`` (SimPO, which has no
reference: ``β ·`` the mean log-prob per response token), and the metrics carry TRL's names
under ``dpo/``: ``dpo/rewards/chosen``, ``dpo/rewards/rejected``, ``dpo/rewards/margins``,
``dpo/rewards/accuracies`` (chosen reward strictly above rejected), ``dpo/logps/chosen``,
``dpo/logps/rejected``.
"""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp

from loomax.dpo.config import DpoConfig
from loomax.models.axes import Batch, Position
from loomax.models.lora.linear import without_adapters


def sequence_logps(model, tokens: jax.Array, mask: jax.Array, *, key=None) -> jax.Array:
    """``[rows]``: the sum over positions ``t`` of ``mask[t] · log p(tokens[t + 1] | tokens[≤ t])``."""
    named = hax.auto_sharded(hax.named(tokens, (Batch, Position)))
    logits = model.logits(named, key=key).array.astype(jnp.float32)  # [rows, position, vocab]
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = jnp.roll(tokens, -1, axis=1)  # the last position's target is masked out
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(picked * mask, axis=1)


def preference_loss(
    chosen: jax.Array,
    rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    chosen_tokens: jax.Array,
    rejected_tokens: jax.Array,
    *,
    loss: str = "sigmoid",
    beta: float = 0.1,
    simpo_gamma_beta_ratio: float = 0.5,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-pair ``(loss, chosen reward, rejected reward)`` from sequence log-probs (summed over
    response tokens; ``*_tokens`` count those tokens).

    sigmoid (Rafailov et al. 2023): ``−log σ(β · (Δ_chosen − Δ_rejected))``, Δ = log π − log π_ref.
    ipo (Azar et al. 2023, with TRL's per-token normalisation):
    ``(Δ_chosen / n_chosen − Δ_rejected / n_rejected − 1 / (2β))²``.
    simpo (Meng et al. 2024, no reference): ``−log σ(β · (ℓ_chosen − ℓ_rejected) − γ)``, ℓ the
    mean log-prob per response token and γ = ``simpo_gamma_beta_ratio`` · β.
    """
    n_chosen = jnp.maximum(chosen_tokens, 1.0)
    n_rejected = jnp.maximum(rejected_tokens, 1.0)
    if loss == "simpo":
        avg_chosen, avg_rejected = chosen / n_chosen, rejected / n_rejected
        margin = beta * (avg_chosen - avg_rejected) - simpo_gamma_beta_ratio * beta
        return -jax.nn.log_sigmoid(margin), beta * avg_chosen, beta * avg_rejected
    delta_chosen, delta_rejected = chosen - ref_chosen, rejected - ref_rejected
    if loss == "sigmoid":
        per_pair = -jax.nn.log_sigmoid(beta * (delta_chosen - delta_rejected))
    elif loss == "ipo":
        per_pair = (delta_chosen / n_chosen - delta_rejected / n_rejected - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {loss!r}")
    return per_pair, beta * delta_chosen, beta * delta_rejected


def preference_metrics(
    chosen_rewards, rejected_rewards, chosen, rejected, valid
) -> dict[str, tuple[jax.Array, jax.Array]]:
    """TRL's metrics under ``dpo/``, as ``(sum, weight)`` over the valid pairs."""
    count = jnp.sum(valid)
    values = {
        "dpo/rewards/chosen": chosen_rewards,
        "dpo/rewards/rejected": rejected_rewards,
        "dpo/rewards/margins": chosen_rewards - rejected_rewards,
        "dpo/rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32),
        "dpo/logps/chosen": chosen,
        "dpo/logps/rejected": rejected,
    }
    return {name: (jnp.sum(v * valid), count) for name, v in values.items()}


def dpo_loss(config: DpoConfig):
    """The trainer's loss on a batch of pairs (``pairs.pair_batches``, with ``ref_chosen`` and
    ``ref_rejected`` log-probs when the reference is cached): ``((sum, pairs), metrics)``.
    Chosen and rejected rows go through the model in one pass; with ``dpo.reference:
    adapters_off`` a second, gradient-free pass of the same model without its adapters
    gives the reference log-probs."""

    def loss_fn(model, batch, *, key=None):
        rows = batch["chosen"].shape[0]
        tokens = jnp.concatenate([batch["chosen"], batch["rejected"]], axis=0)
        mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)
        logps = sequence_logps(model, tokens, mask, key=key)
        chosen, rejected = logps[:rows], logps[rows:]
        zeros = jnp.zeros_like(chosen)
        ref_chosen, ref_rejected = batch.get("ref_chosen", zeros), batch.get("ref_rejected", zeros)
        if adapters_off:  # the policy's own frozen base, in this step: no second copy
            base = jax.lax.stop_gradient(without_adapters(model))
            ref = sequence_logps(base, tokens, mask)
            ref_chosen, ref_rejected = ref[:rows], ref[rows:]
        per_pair, chosen_rewards, rejected_rewards = preference_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            jnp.sum(batch["chosen_mask"], axis=1),
            jnp.sum(batch["rejected_mask"], axis=1),
            loss=config.loss,
            beta=config.beta,
            simpo_gamma_beta_ratio=config.simpo_gamma_beta_ratio,
        )
        valid = batch["valid"]
        metrics = preference_metrics(chosen_rewards, rejected_rewards, chosen, rejected, valid)
        return (jnp.sum(per_pair * valid), jnp.sum(valid)), metrics

    adapters_off = config.uses_reference and config.reference == "adapters_off"
    loss_fn.uses_reference = config.cached_reference  # the batch carries ref_chosen, ref_rejected
    return loss_fn
