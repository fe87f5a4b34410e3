"""EMA weights: kept in the state, equal to the hand-computed average, used for eval when asked."""

from __future__ import annotations

import jax
import numpy as np

from loomax.hooks import EmaHook, EvalHook


def embedding(model):
    return np.asarray(model.token_embeddings.weight.array)


def test_ema_matches_hand_average_and_is_evaluated(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=3)
    trainer.add_hook(EmaHook(decay=0.5, use_for_eval=True))
    seen, evaluated = [], []
    trainer.add_hook(lambda info: seen.append(embedding(info.state.model)))
    trainer.add_hook(
        EvalHook(
            evaluate=lambda model: evaluated.append(embedding(model)) or {"eval/loss": 1.0},
            every=3,
            at_start=False,
        )
    )
    state = tiny.init(trainer)
    expected = embedding(state.model)
    final = trainer.train(state, tiny.batches())
    for params in seen:
        expected = 0.5 * expected + 0.5 * params
    ema = np.asarray(jax.device_get(final.state.extras["ema"].token_embeddings.weight.array))
    np.testing.assert_allclose(ema, expected, rtol=1e-6)
    assert not np.allclose(ema, seen[-1])
    np.testing.assert_allclose(evaluated[-1], ema, rtol=1e-6)  # eval saw the EMA weights
