"""Sequence-length warm-up: short sequences first, same tokens per batch, growing linearly."""

from __future__ import annotations

import numpy as np

from loomax.hooks.seq_len_warmup import SeqLenWarmupHook


def test_lengths_grow_linearly_and_keep_tokens(tiny, tmp_path):
    hook = SeqLenWarmupHook(seq_len=16, min_seq_len=4, warmup_steps=4)
    assert [hook.length_at(s) for s in range(1, 8)] == [4, 4, 8, 8, 16, 16, 16]  # 4, 7, 10, 13, 16
    batch = np.arange(4 * 16).reshape(4, 16)
    short = hook.transform_batch(1, batch)
    assert short.shape == (16, 4) and (short.reshape(4, 16) == batch).all()
    assert hook.transform_batch(5, batch) is batch

    trainer = tiny.trainer(tmp_path, steps=5)
    trainer.add_hook(hook)
    final = trainer.train(tiny.init(trainer), tiny.batches())
    assert final.step == 5 and np.isfinite(final.loss)
    assert trainer.compilations() == 3  # one compile per length
