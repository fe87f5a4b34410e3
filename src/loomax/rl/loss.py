"""The GRPO family's policy loss on a batch of rollouts, with ``rl/`` metrics.

Per response token ``t`` of row ``i``: the ratio ``r = π(y_t) / π_old(y_t)`` (``π_old``
the policy that sampled the rollout), the clipped surrogate
``ℓ = −min(r·A_i, clip(r, 1 − ε_low, 1 + ε_high)·A_i)`` and, with ``kl_beta`` β > 0, the k3
estimate of KL(π ‖ π_ref) added as ``β·(exp(d) − d − 1)``, ``d = log π_ref − log π``.
The normalisations (TRL's ``loss_type`` names them alike):

- ``grpo``: each row's mean over its response tokens, averaged over rows;
- ``dapo``: the sum over all response tokens over their number (token level);
- ``dr_grpo``: the sum over all response tokens over ``rows · max_response_len`` (a constant).

The loss returns ``(sum, weight)`` pairs so that microbatches and devices add up exactly.
"""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp

from loomax.models.axes import Batch, Position

NORMALISATIONS = ("grpo", "dapo", "dr_grpo")
"""The loss normalisations ``rl.loss`` may name."""


def token_logps(
    model, tokens: jax.Array, *, temperature: float = 1.0, key=None
) -> tuple[jax.Array, jax.Array]:
    """``([rows, position] log p(tokens[t + 1] | tokens[≤ t]), [rows, position] entropy)``
    of the softmax at ``temperature`` (the last position's values are of a rolled-in token:
    masked out by callers)."""
    named = hax.auto_sharded(hax.named(tokens, (Batch, Position)))
    logits = model.logits(named, key=key).array.astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    targets = jnp.roll(tokens, -1, axis=1)
    picked = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return picked, entropy


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    ref_logp: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    normalisation: str = "grpo",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kl_beta: float = 0.0,
    max_response_len: int = 1,
) -> tuple[jax.Array, jax.Array, dict[str, tuple[jax.Array, jax.Array]]]:
    """``(sum, weight, metrics)`` of the loss over ``[rows, position]`` token log-probs;
    ``mask`` is 1 at response tokens of valid rows (0 elsewhere)."""
    ratio = jnp.exp(logp - old_logp)
    adv = advantages[:, None]
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    kl = jnp.zeros_like(logp)
    if kl_beta > 0 and ref_logp is not None:
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
        per_token = per_token + kl_beta * kl
    tokens_per_row = jnp.sum(mask, axis=1)
    rows = jnp.sum(tokens_per_row > 0).astype(jnp.float32)
    if normalisation == "grpo":
        total = jnp.sum(jnp.sum(per_token * mask, axis=1) / jnp.maximum(tokens_per_row, 1.0))
        weight = rows
    elif normalisation == "dapo":
        total, weight = jnp.sum(per_token * mask), jnp.sum(mask)
    elif normalisation == "dr_grpo":
        total, weight = jnp.sum(per_token * mask) / max_response_len, rows
    else:
        raise ValueError(f"unknown rl.loss {normalisation!r}: one of {', '.join(NORMALISATIONS)}")
    n_tokens = jnp.sum(mask)
    low = (ratio < 1.0 - eps_low) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    metrics = {
        "rl/kl": (jnp.sum(kl * mask), n_tokens),
        "rl/clip_fraction": (jnp.sum((low | high) * mask), n_tokens),
        "rl/clip_fraction_low": (jnp.sum(low * mask), n_tokens),
        "rl/clip_fraction_high": (jnp.sum(high * mask), n_tokens),
        "rl/ratio": (jnp.sum(ratio * mask), n_tokens),
    }
    return total, weight, metrics


def grpo_loss(config):
    """The trainer's loss on a batch of rollouts (``rl.batches``): ``((sum, weight), metrics)``.
    The batch holds ``tokens``, ``mask`` (response tokens of valid rows, at the position that
    predicts them), ``old_logp``, ``advantages`` and, with ``rl.kl_beta`` > 0, ``ref_logp``."""

    def loss_fn(model, batch, *, key=None):
        logp, entropy = token_logps(model, batch["tokens"], temperature=config.temperature, key=key)
        mask = batch["mask"]
        total, weight, metrics = policy_loss(
            logp,
            batch["old_logp"],
            batch.get("ref_logp"),
            batch["advantages"],
            mask,
            normalisation=config.loss,
            eps_low=config.eps_low,
            eps_high=config.eps_high,
            kl_beta=config.kl_beta,
            max_response_len=config.max_new_tokens,
        )
        metrics["rl/entropy"] = (jnp.sum(entropy * mask), jnp.sum(mask))
        return (total, weight), metrics

    return loss_fn
