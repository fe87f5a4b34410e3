"""Metrics a loss function returns: logged under train/ and eval/, exact over microbatches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

from loomax.hooks import make_loss_evaluator
from loomax.lm import lm_loss
from loomax.tracking import read_metrics


def loss_with_metrics():
    """The LM loss, with a mean (over tokens), a ratio and a plain sum beside it."""
    base = lm_loss()

    def loss_fn(model, tokens, *, key=None):
        (total, weight), _ = base(model, tokens, key=key)
        t = jnp.asarray(tokens, jnp.float32)
        metrics = {
            "token_mean": jnp.sum(t[:, 1:]) / weight,  # a mean: weighted like the loss
            "first_share": (jnp.sum(t[:, 0] == 0), t.shape[0]),  # an explicit (sum, weight)
            "rows": (t.shape[0], None),  # a plain sum
        }
        return (total, weight), metrics

    return loss_fn


def expected(batch):
    t = batch.astype(np.float64)
    return {"token_mean": t[:, 1:].mean(), "first_share": np.mean(t[:, 0] == 0), "rows": 4}


@pytest.mark.parametrize("parallelism", [-1, 1])
def test_train_metrics_from_the_loss_are_logged_and_exact_over_microbatches(
    tiny, tmp_path, parallelism
):
    trainer = tiny.trainer(
        tmp_path, steps=2, loss_fn=loss_with_metrics(), per_device_parallelism=parallelism
    )
    trainer.add_hook(lambda info: info.log(info.host_metrics()))  # what LogMetricsHook does
    batches = [b for _, b in zip(range(2), tiny.batches(seed=3), strict=False)]
    batches[1][:, 0] = 0  # a known share of rows starting with token 0
    final = trainer.train(tiny.init(trainer), iter(batches))
    trainer.finish()
    assert trainer.num_microbatches == (4 if parallelism == 1 else 1)
    logged = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    for step, batch in zip((1, 2), batches, strict=True):
        for name, value in expected(batch).items():
            assert logged[step][f"train/{name}"] == pytest.approx(value, rel=1e-6), name
    assert final.host_metrics()["train/rows"] == 4


def test_eval_metrics_from_the_loss_over_batches_and_microbatches(tiny):
    rng = np.random.default_rng(0)
    sets = {
        "a": [rng.integers(0, tiny.vocab, (4, tiny.model.seq_len), dtype=np.int32) for _ in "xy"],
        "b": [rng.integers(0, tiny.vocab, (4, tiny.model.seq_len), dtype=np.int32)],
    }
    sets["a"][0][:3, 0] = 0
    model = tiny.model.build(tiny.vocab, key=jax.random.PRNGKey(0))
    policy = jmp.get_policy("f32")
    whole = make_loss_evaluator(loss_with_metrics(), sets, policy)(model)
    split = make_loss_evaluator(loss_with_metrics(), sets, policy, microbatch_rows=1)(model)
    a = np.concatenate(sets["a"])
    assert whole["eval/a/token_mean"] == pytest.approx(a[:, 1:].mean(), rel=1e-6)
    assert whole["eval/a/first_share"] == pytest.approx(3 / 8)  # summed over both batches
    assert whole["eval/a/rows"] == 8 and whole["eval/b/rows"] == 4
    assert whole["eval/rows"] == 6  # the macro average over the sets
    for key, value in whole.items():
        assert split[key] == pytest.approx(value, rel=1e-5), key


def test_a_loss_metric_may_not_take_a_reserved_name(tiny, tmp_path):
    base = lm_loss()
    trainer = tiny.trainer(
        tmp_path, steps=1, loss_fn=lambda m, b, *, key=None: (base(m, b, key=key), {"loss": 1.0})
    )
    with pytest.raises(ValueError, match="metric named 'loss'"):
        trainer.train(tiny.init(trainer), tiny.batches())
