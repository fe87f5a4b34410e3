"""Text generation: samples from fixed prompts every N steps join the logged record."""

from __future__ import annotations

from loomax.callbacks import TextGenHook


def test_samples_are_logged_every_n_steps(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=4)
    letters = "abcdefghijklmnopqrstuvwxyz "
    hook = TextGenHook(
        every=2,
        prompts=["ab", "z"],
        encode=lambda text: [letters.index(c) for c in text],
        decode=lambda ids: "".join(letters[i % len(letters)] for i in ids),
        seq_len=tiny.model.seq_len,
        max_new_tokens=5,
    )
    trainer.add_hook(hook)
    records = {}
    trainer.add_hook(lambda info: records.update({info.step: dict(info.record)}), priority=-1)
    trainer.train(tiny.init(trainer), tiny.batches())
    assert [s for s, _ in hook.samples] == [2, 4]
    for step in (2, 4):
        texts = [records[step]["samples/0"], records[step]["samples/1"]]
        assert texts[0].startswith("ab") and texts[1].startswith("z")
        assert len(texts[0]) == 2 + 5 and len(texts[1]) == 1 + 5
    assert 1 not in records or "samples/0" not in records[1]
