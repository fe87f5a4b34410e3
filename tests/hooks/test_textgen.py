"""Text generation: samples from fixed prompts every N steps join the logged record."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import pytest

from loomax.errors import MissingFileError
from loomax.hooks import TextGenHook
from loomax.hooks.textgen import read_prompts
from loomax.train import StepInfo


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


def test_prompts_from_a_file_and_top_k_sampling(tiny, tmp_path):
    letters = "abcdefghijklmnopqrstuvwxyz "
    settings = {
        "encode": lambda text: [letters.index(c) for c in text],
        "decode": lambda ids: "".join(letters[i % len(letters)] for i in ids),
        "seq_len": tiny.model.seq_len,
        "max_new_tokens": 6,
    }
    (tmp_path / "prompts.json").write_text(json.dumps(["ab c", "zz"]))
    model = tiny.model.build(tiny.vocab, key=jax.random.PRNGKey(1))

    def sample(**options):
        hook = TextGenHook(prompts_file=str(tmp_path / "prompts.json"), **settings, **options)
        info = StepInfo(10, SimpleNamespace(model=model), {})
        hook.on_step(info)
        return [info.record[f"samples/{i}"] for i in range(len(hook.prompts))]

    greedy = sample(temperature=0.0)
    assert greedy[0].startswith("ab c") and greedy[1].startswith("zz")
    assert sample(temperature=1.0, top_k=1) == greedy  # one token left: the most likely
    assert sample(temperature=5.0, seed=3) != greedy  # hot sampling without a limit differs
    (tmp_path / "lines.txt").write_text("first\n\nsecond prompt\n")
    assert read_prompts(tmp_path / "lines.txt") == ["first", "second prompt"]
    with pytest.raises(MissingFileError, match=r"\(textgen\): prompts_file .*nope.txt not found"):
        TextGenHook(prompts_file=str(tmp_path / "nope.txt"), **settings)
    with pytest.raises(ValueError, match=r"\(textgen\): top_p must be in"):
        TextGenHook(top_p=1.5, **settings)
    penalised = sample(temperature=0.0, repetition_penalty=1e4)
    assert penalised != greedy and all(len(set(t[4:])) == len(t[4:]) for t in penalised[:1])
    with pytest.raises(ValueError, match=r"\(textgen\): repetition_penalty must be > 0"):
        TextGenHook(repetition_penalty=0.0, **settings)
