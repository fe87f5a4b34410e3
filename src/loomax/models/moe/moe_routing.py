"""Routing of a mixture-of-experts layer: top-k choice, balance losses and router metrics.

``route`` turns router logits into each token's k experts and their weights. Scores are a
softmax over all experts (Mixtral, OLMoE, Qwen3-MoE) or per-expert sigmoids (DeepSeek-V3);
the k highest are chosen (with an optional per-expert ``bias`` added for the choice only:
aux-loss-free balancing), and their weights are the chosen scores, renormalised to sum 1
when ``norm_topk_prob``, times ``scale`` (DeepSeek-V3's ``routed_scaling_factor``).
Group-limited routing (DeepSeek-V3's ``n_group``, ``topk_group``): the experts are split
into ``groups`` equal groups in order, each group scored by the sum of its two best
(biased) scores, and a token's k experts are chosen among its ``topk_groups`` best groups.

``RouterAux`` travels through the layer stack with the residual stream and gathers, per
MoE layer, the two balance losses and what the metrics report:

- load-balance loss (Switch Transformer; Fedus et al. 2021), normalised to **1 at perfect
  balance** for any k: ``E * sum_e f_e * p_e`` with ``f_e`` the fraction of the T*k
  assignments that went to expert e and ``p_e`` the mean router probability of e (for
  sigmoid scores, each token's scores normalised to sum 1). HF transformers' Mixtral/OLMoE
  ``load_balancing_loss_func`` and MaxText equal k times this at balance, Levanter's
  Mixtral 1/k times it: their coefficients are not this one's;
- router z-loss (ST-MoE; Zoph et al. 2022): the mean over tokens of ``logsumexp(logits)**2``.

Both are averaged over the MoE layers and enter the training loss times
``model.moe.load_balance_loss_weight`` and ``model.moe.router_z_loss_weight``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def route(
    logits: jax.Array,
    k: int,
    *,
    score: str = "softmax",
    norm_topk_prob: bool = True,
    bias: jax.Array | None = None,
    groups: int = 1,
    topk_groups: int = 1,
    scale: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(weights [T, k], experts [T, k], probs [T, E])`` for router ``logits [T, E]``.

    ``probs`` are the scores as a distribution over experts (what the load-balance loss and
    the entropy use). ``bias [E]`` shifts the choice only, never the weights. With
    ``groups`` > 1 the choice is limited to each token's ``topk_groups`` best groups.
    """
    logits = logits.astype(jnp.float32)
    if score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    elif score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        raise ValueError(f"router score must be one of {SCORE_FUNCTIONS}, got {score!r}")
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias)
    if groups > 1:
        choice = _within_best_groups(jax.lax.stop_gradient(choice), groups, topk_groups)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if scale != 1.0:
        weights = weights * scale
    return weights, experts, probs


def _within_best_groups(choice: jax.Array, groups: int, topk_groups: int) -> jax.Array:
    """``choice [T, E]`` with the experts outside each token's ``topk_groups`` best groups
    set to -inf; a group's score is the sum of its two best entries."""
    grouped = choice.reshape(*choice.shape[:-1], groups, choice.shape[-1] // groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)
    _, best = jax.lax.top_k(group_scores, topk_groups)
    keep = jnp.any(best[..., :, None] == jnp.arange(groups), axis=-2)  # [T, groups]
    masked = jnp.where(keep[..., None], grouped, -jnp.inf)
    return masked.reshape(choice.shape)


def load_balance_loss(group_sizes: jax.Array, probs: jax.Array) -> jax.Array:
    """``E * sum_e f_e * p_e``: 1 at perfect balance (see the module docstring).
    ``group_sizes [E]`` counts assignments per expert, ``probs [T, E]`` the router's."""
    num_experts = probs.shape[-1]
    f = group_sizes.astype(jnp.float32) / jnp.sum(group_sizes)
    return num_experts * jnp.sum(f * jnp.mean(probs, axis=0))


def router_z_loss(logits: jax.Array) -> jax.Array:
    """Mean over tokens of ``logsumexp(logits)**2``."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


class RouterAux(eqx.Module):
    """Per-layer router statistics, filled in by each MoE layer as the stack runs.

    ``load [layers, E]`` is each expert's share of the assignments times E (1 = balanced),
    ``dropped [layers]`` the fraction of assignments over capacity, ``entropy [layers]``
    the mean entropy (nats) of the router's distribution; ``balance`` and ``z`` the two
    losses per layer (differentiable; the rest carry no gradient); ``recomputed [layers]``
    the fraction of devices whose routed rows exceeded the rows kept for the backward
    (``model.moe.saved_rows``: they recompute the experts' forward).
    """

    balance: jax.Array
    z: jax.Array
    load: jax.Array
    entropy: jax.Array
    dropped: jax.Array
    recomputed: jax.Array

    @staticmethod
    def zeros(num_layers: int, num_experts: int) -> RouterAux:
        z = jnp.zeros((num_layers,), jnp.float32)
        return RouterAux(z, z, jnp.zeros((num_layers, num_experts), jnp.float32), z, z, z)

    def record(
        self,
        layer: jax.Array,
        logits: jax.Array,
        probs: jax.Array,
        group_sizes: jax.Array,
        dropped: jax.Array,
        recomputed: jax.Array | float = 0.0,
    ) -> RouterAux:
        """This aux with row ``layer`` set from that layer's routing."""
        sg = jax.lax.stop_gradient
        p = sg(probs)
        total = jnp.sum(group_sizes).astype(jnp.float32)
        load = group_sizes.astype(jnp.float32) * probs.shape[-1] / total
        entropy = -jnp.mean(jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1))
        return RouterAux(
            self.balance.at[layer].set(load_balance_loss(group_sizes, probs)),
            self.z.at[layer].set(router_z_loss(logits)),
            self.load.at[layer].set(sg(load)),
            self.entropy.at[layer].set(entropy),
            self.dropped.at[layer].set(sg(dropped.astype(jnp.float32) / total)),
            self.recomputed.at[layer].set(sg(jnp.asarray(recomputed, jnp.float32))),
        )

    def losses(self, balance_weight: float, z_weight: float) -> dict[str, jax.Array]:
        """The weighted terms the training loss adds (each a per-token mean)."""
        out = {}
        if balance_weight:
            out["load_balance"] = balance_weight * jnp.mean(self.balance)
        if z_weight:
            out["router_z"] = z_weight * jnp.mean(self.z)
        return out

    def metrics(self) -> dict[str, jax.Array]:
        """``moe/...`` scalars: the unweighted losses, dropped fraction, recomputed fraction
        (mean over layers), and per layer the load's max, min and coefficient of variation
        and the router entropy."""
        sg = jax.lax.stop_gradient
        out = {
            "moe/load_balance_loss": sg(jnp.mean(self.balance)),
            "moe/router_z_loss": sg(jnp.mean(self.z)),
            "moe/dropped_fraction": jnp.mean(self.dropped),
            "moe/recomputed_fraction": jnp.mean(self.recomputed),
        }
        num_layers = self.load.shape[0]
        width = len(str(num_layers - 1))
        cv = jnp.std(self.load, axis=-1) / jnp.mean(self.load, axis=-1)
        for i in range(num_layers):
            where = f"moe/layer_{i:0{width}d}"
            out[f"{where}/load_max"] = jnp.max(self.load[i])
            out[f"{where}/load_min"] = jnp.min(self.load[i])
            out[f"{where}/load_cv"] = cv[i]
            out[f"{where}/router_entropy"] = self.entropy[i]
            out[f"{where}/dropped_fraction"] = self.dropped[i]
        return out
