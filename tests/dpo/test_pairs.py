"""Preference pairs: bad lines named by file and line, response masks over response tokens only."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from loomax.dpo.pairs import Pair, fill_column, pair_batches, read_pairs, tokenize_pairs
from loomax.errors import DataSourceError, MissingFileError


def _write(tmp_path, lines):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


GOOD = {"prompt": "p", "chosen": "a", "rejected": "b"}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": "p", "chosen": "a"}, "pairs.jsonl:3: the pair has no 'rejected'"),
        (
            {"prompt": "p", "chosen": "a", "rejected": 3},
            "pairs.jsonl:3: 'rejected' must be a string",
        ),
        ({"prompt": "p", "chosen": "", "rejected": "b"}, "pairs.jsonl:3: 'chosen' is empty"),
        ("{not json", "pairs.jsonl:3: not a JSON object"),
    ],
)
def test_a_bad_pair_is_named_by_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path, [GOOD, "", bad])  # a blank line still counts as a line
    with pytest.raises(DataSourceError, match=message):
        read_pairs(path)


def test_missing_and_empty_files_are_named(tmp_path):
    with pytest.raises(MissingFileError, match="nope.jsonl"):
        read_pairs(tmp_path / "nope.jsonl")
    with pytest.raises(DataSourceError, match="no preference pairs"):
        read_pairs(_write(tmp_path, [""]))
    assert read_pairs(_write(tmp_path, [GOOD])) == [Pair("p", "a", "b")]


def _char_tokenizer():
    """One token per space-separated letter (ids from the vocab below), EOS = 0."""
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate("abcdefghijxyz")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer, vocab


def test_rows_are_eos_prompt_response_eos_and_the_mask_marks_the_positions_predicting_the_response():
    tokenizer, v = _char_tokenizer()
    pairs = [Pair("a b c", "x y", "z"), Pair("a b c d e f g h i j", "x y z", "z z")]
    arrays = tokenize_pairs(pairs, tokenizer, eos=0, seq_len=8)
    row = [0, v["a"], v["b"], v["c"], v["x"], v["y"], 0, 0]  # [EOS] prompt response EOS, padding
    np.testing.assert_array_equal(arrays.chosen[0], row)
    np.testing.assert_array_equal(
        arrays.chosen_mask[0], [0, 0, 0, 1, 1, 1, 0, 0]
    )  # predicts x, y, EOS
    np.testing.assert_array_equal(arrays.rejected_mask[0], [0, 0, 0, 1, 1, 0, 0, 0])  # z, EOS
    # too long: the whole response, the end of the prompt
    np.testing.assert_array_equal(
        arrays.chosen[1], [0, v["h"], v["i"], v["j"], v["x"], v["y"], v["z"], 0]
    )
    assert arrays.chosen_mask[1].sum() == 4
    capped = tokenize_pairs(pairs[:1], tokenizer, eos=0, seq_len=8, max_prompt_len=1)
    np.testing.assert_array_equal(capped.chosen[0][:3], [0, v["c"], v["x"]])


def test_the_last_batch_is_padded_with_rows_that_do_not_count():
    tokenizer, _ = _char_tokenizer()
    arrays = tokenize_pairs([Pair("a", "b", "c")] * 5, tokenizer, eos=0, seq_len=6)
    batches = pair_batches(arrays, 2, {"ref_chosen": np.arange(5.0)})
    assert len(batches) == 3
    np.testing.assert_array_equal(batches[2]["valid"], [1.0, 0.0])
    np.testing.assert_array_equal(batches[2]["ref_chosen"], [4.0, 0.0])
    fill_column(batches, "ref_chosen", np.arange(10.0, 15.0))  # the reference pass, later
    np.testing.assert_array_equal(batches[1]["ref_chosen"], [12.0, 13.0])
    np.testing.assert_array_equal(batches[2]["ref_chosen"], [14.0, 0.0])


def test_chat_pairs_render_with_the_template_and_mask_the_reply(tmp_path, repo_root):
    """A prompt of messages (TRL's conversational form; a reply as a string or one assistant
    message): each side is the conversation with the reply as `loomax train` renders chat
    data, and the mask marks the positions predicting the reply and its end of turn."""
    from loomax.data.chat.encode import encode_chat, load_template
    from loomax.data.tokenizer import load_tokenizer

    question = [{"role": "user", "content": "sort: d a c ="}]
    reply = [{"role": "assistant", "content": "a c d"}]
    path = _write(tmp_path, [{"prompt": question, "chosen": reply, "rejected": "d c a"}])
    (pair,) = read_pairs(path)
    assert pair.is_chat and pair.chosen == "a c d" and pair.rejected == "d c a"
    tokenizer_path = repo_root / "data" / "chat_tiny" / "tokenizer.json"
    tokenizer = load_tokenizer(tokenizer_path)
    template = load_template("loomax", tokenizer, tokenizer_path)
    arrays = tokenize_pairs([pair], tokenizer, eos=0, seq_len=48, template=template)
    ids, trained = encode_chat([*question, *reply], template, tokenizer)
    np.testing.assert_array_equal(arrays.chosen[0, : len(ids)], ids)
    predicted = arrays.chosen[0, 1:][arrays.chosen_mask[0, :-1] > 0]
    assert tokenizer.decode(list(predicted), skip_special_tokens=False) == "a c d<|endoftext|>\n"
    assert int(arrays.chosen_mask[0].sum()) == int(trained.sum())
    predicted = arrays.rejected[0, 1:][arrays.rejected_mask[0, :-1] > 0]
    assert tokenizer.decode(list(predicted), skip_special_tokens=False) == "d c a<|endoftext|>\n"
    bad = _write(tmp_path, [{"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataSourceError, match="pairs.jsonl:1: 'prompt': turn 0 has no string"):
        read_pairs(bad)
