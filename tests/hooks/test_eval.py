"""The evaluator: named validation sets, macro averages, bits per byte; usable without a Trainer."""

from __future__ import annotations

import math

import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loomax.hooks import make_loss_evaluator, next_token_bytes, token_byte_lengths

F32 = jmp.get_policy("f32")


def constant_loss(model, batch, *, key=None):
    """Each batch: loss sum = model * its first value, weight = its row count."""
    return model * batch[0, 0], jnp.asarray(batch.shape[0], jnp.float32)


def test_named_sets_macro_average_and_bpb():
    sets = {
        "a": [np.full((2, 3), 1.0), np.full((2, 3), 3.0)],  # sum 1 + 3 over 4 rows: loss 1
        "b": [np.full((4, 3), 8.0)],  # sum 8 over 4 rows: loss 2
    }
    count = lambda batch: jnp.asarray(batch.shape[0] * 2.0)  # noqa: E731 - 2 bytes per row
    out = make_loss_evaluator(constant_loss, sets, F32, count_bytes=count)(1.0)
    assert out["eval/a/loss"] == pytest.approx(1.0) and out["eval/b/loss"] == pytest.approx(2.0)
    assert out["eval/loss"] == pytest.approx(1.5)
    assert out["eval/perplexity"] == pytest.approx(math.exp(1.5))
    assert out["eval/a/bpb"] == pytest.approx(4 / (8 * math.log(2)))  # 4 nats over 8 bytes
    assert out["eval/bpb"] == pytest.approx((out["eval/a/bpb"] + out["eval/b/bpb"]) / 2)
    single = make_loss_evaluator(constant_loss, sets["b"], F32)(1.0)
    assert single == {"eval/loss": pytest.approx(2.0), "eval/perplexity": pytest.approx(math.e**2)}
    with pytest.raises(ValueError, match="'c' has no batches"):
        make_loss_evaluator(constant_loss, {"c": []}, F32)


def test_token_byte_lengths_of_byte_level_bpe():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["déjà vu, naïve café", "def f(x): return x"] * 20, trainer)
    lengths = token_byte_lengths(tokenizer, 320)
    text = "café déjà, def g(y)"
    ids = tokenizer.encode(text).ids
    assert lengths[ids].sum() == len(text.encode("utf-8"))
    assert lengths[tokenizer.token_to_id("<|endoftext|>")] == 0 and lengths[310] == 0
    tokens = np.asarray([[0, *ids]])
    assert int(next_token_bytes(lengths)(tokens)) == len(text.encode("utf-8"))


def test_batches_stay_on_the_host_until_each_is_evaluated():
    placed = []

    def prepare(batch):  # stands for runtime.shard_batch: records each transfer
        placed.append(batch)
        return jnp.asarray(batch)

    sets = {"a": [np.full((2, 3), 1.0), np.full((2, 3), 3.0)], "b": [np.full((4, 3), 8.0)]}
    evaluate = make_loss_evaluator(constant_loss, sets, F32, prepare=prepare)
    assert placed == []  # nothing is put on the devices when the evaluator is made
    first = evaluate(1.0)
    assert [float(b[0, 0]) for b in placed] == [1.0, 3.0, 8.0]  # one transfer per batch, in order
    assert evaluate(1.0) == first and len(placed) == 6  # each eval transfers them again
    assert first == make_loss_evaluator(constant_loss, sets, F32)(1.0)


def test_microbatched_eval_equals_the_unsplit_eval(tiny):
    import jax

    from loomax.lm import lm_loss

    seen = []
    base = lm_loss()

    def loss(model, batch, *, key=None):
        seen.append(batch.shape)  # traced shapes: what one forward pass holds
        return base(model, batch, key=key)

    model = tiny.model.build(tiny.vocab, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    batches = [
        rng.integers(0, tiny.vocab, (8, tiny.model.seq_len), dtype=np.int32) for _ in range(2)
    ]
    batches.append(batches[0][:2])  # a smaller last batch is evaluated whole
    count = lambda b: jnp.asarray(b.shape[0] * 3.0)  # noqa: E731
    whole = make_loss_evaluator(loss, batches, F32, count_bytes=count)(model)
    assert {s[0] for s in seen} == {8, 2}
    seen.clear()
    split = make_loss_evaluator(loss, batches, F32, count_bytes=count, microbatch_rows=2)(model)
    assert {s[0] for s in seen} == {2}  # 8-row batches went through in microbatches of 2
    assert split.keys() == whole.keys()
    for k in whole:
        assert split[k] == pytest.approx(whole[k], rel=1e-5)
    with pytest.raises(ValueError, match="microbatches of 3 rows do not divide a batch of 8"):
        make_loss_evaluator(loss, batches, F32, microbatch_rows=3)(model)
