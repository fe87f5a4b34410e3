"""The GRPO-family loss equals a hand-derived numpy reference for each normalisation, with
and without the KL term, and TRL's ``GRPOTrainer._compute_loss`` on the same log-probs."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from loomax.rl.loss import policy_loss

ROWS, LEN, MAX_NEW = 6, 7, 7


@pytest.fixture(scope="module")
def numbers():
    rng = np.random.default_rng(0)
    logp = rng.normal(-1.5, 0.5, (ROWS, LEN)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (ROWS, LEN))).astype(np.float32)  # ratios beyond the clip
    ref = (logp + rng.normal(0, 0.2, (ROWS, LEN))).astype(np.float32)
    adv = rng.normal(0, 1, ROWS).astype(np.float32)
    lengths = np.array([7, 3, 5, 1, 6, 4])
    mask = (np.arange(LEN)[None] < lengths[:, None]).astype(np.float32)
    return logp, old, ref, adv, mask


def numpy_loss(logp, old, ref, adv, mask, normalisation, eps_low, eps_high, beta):
    """The loss written out: ratio, clipped surrogate, k3 KL, then the normalisation."""
    ratio = np.exp(logp.astype(np.float64) - old)
    surrogate = np.minimum(
        ratio * adv[:, None], np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv[:, None]
    )
    d = ref.astype(np.float64) - logp
    per_token = -surrogate + beta * (np.exp(d) - d - 1)
    if normalisation == "grpo":
        return np.mean((per_token * mask).sum(1) / mask.sum(1))
    if normalisation == "dapo":
        return (per_token * mask).sum() / mask.sum()
    return (per_token * mask).sum() / (ROWS * MAX_NEW)


CASES = [("grpo", 0.2, 0.2, 0.0), ("grpo", 0.2, 0.2, 0.04), ("dapo", 0.2, 0.28, 0.0),
         ("dr_grpo", 0.2, 0.2, 0.1)]  # fmt: skip


@pytest.mark.parametrize("normalisation,eps_low,eps_high,beta", CASES)
def test_the_loss_is_the_hand_derived_one(numbers, normalisation, eps_low, eps_high, beta):
    total, weight, metrics = policy_loss(
        *numbers, normalisation=normalisation, eps_low=eps_low, eps_high=eps_high, kl_beta=beta,
        max_response_len=MAX_NEW,
    )  # fmt: skip
    want = numpy_loss(*numbers, normalisation, eps_low, eps_high, beta)
    assert float(total / weight) == pytest.approx(want, rel=1e-5)
    logp, old, ref, adv, mask = numbers
    ratio = np.exp(logp - old)
    clipped = ((ratio < 1 - eps_low) & (adv[:, None] < 0)) | (
        (ratio > 1 + eps_high) & (adv[:, None] > 0)
    )
    s, w = metrics["rl/clip_fraction"]
    assert float(s / w) == pytest.approx((clipped * mask).sum() / mask.sum(), rel=1e-6)
    assert 0 < float(s / w) < 1  # the case exercises the clip
    if beta:
        d = ref - logp
        s, w = metrics["rl/kl"]
        assert float(s / w) == pytest.approx(
            ((np.exp(d) - d - 1) * mask).sum() / mask.sum(), rel=1e-5
        )


class _TrlLoss:
    """What ``GRPOTrainer._compute_loss`` reads of its trainer, the log-probs given: TRL's own
    loss code runs on them, no model, no hub."""

    def __init__(self, loss_type, eps_low, eps_high, beta, logp):
        import torch

        self.loss_type, self.epsilon_low, self.epsilon_high, self.beta = (
            loss_type,
            eps_low,
            eps_high,
            beta,
        )
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
        self.importance_sampling_level, self.use_vllm = "token", False
        self.args = SimpleNamespace(
            use_bias_correction_kl=False, delta=None, steps_per_generation=1
        )
        self.model = SimpleNamespace(training=True)
        self.current_gradient_accumulation_steps, self.max_completion_length = 1, MAX_NEW
        self._entropy_bonus_enabled, self.aux_loss_enabled = False, False
        self._metrics = defaultdict(lambda: defaultdict(list))
        self.accelerator = SimpleNamespace(
            gather=lambda x: x, reduce=lambda x, reduction: x, num_processes=1
        )
        self._logp = torch.tensor(logp, dtype=torch.float64)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self._logp, self._logp.exp(), None


@pytest.mark.parametrize("normalisation,eps_low,eps_high,beta", CASES)
def test_the_loss_equals_trls_grpo_loss(numbers, normalisation, eps_low, eps_high, beta):
    torch = pytest.importorskip("torch")
    from trl.trainer.grpo_trainer import GRPOTrainer

    logp, old, ref, adv, mask = numbers
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    inputs = {
        "prompt_ids": torch.zeros((ROWS, 1), dtype=torch.long),
        "prompt_mask": torch.ones((ROWS, 1), dtype=torch.long),
        "completion_ids": torch.zeros((ROWS, LEN), dtype=torch.long),
        "completion_mask": t(mask),
        "advantages": t(adv),
        "old_per_token_logps": t(old),
        "ref_per_token_logps": t(ref),
        "num_items_in_batch": t(mask.sum()),
    }
    stand_in = _TrlLoss(normalisation, eps_low, eps_high, beta, logp)
    trl = float(GRPOTrainer._compute_loss(stand_in, None, inputs))
    total, weight, _ = policy_loss(
        *numbers, normalisation=normalisation, eps_low=eps_low, eps_high=eps_high, kl_beta=beta,
        max_response_len=MAX_NEW,
    )  # fmt: skip
    assert float(total / weight) == pytest.approx(trl, rel=1e-5)
