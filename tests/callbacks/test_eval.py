"""The evaluator: named validation sets, macro averages, bits per byte; usable without a Trainer."""

from __future__ import annotations

import math

import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loomax.callbacks import make_loss_evaluator, next_token_bytes, token_byte_lengths

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
