"""Chat templates render as transformers renders them, and the loss mask picks the chosen turns."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loomax.data.chat.encode import (
    check_messages,
    encode_chat,
    load_template,
    prompt_ids,
    read_chat_arg,
)
from loomax.data.chat.render import message_spans
from loomax.data.chat.templates import SHIPPED
from loomax.data.tokenizer import EOS_TOKEN, train_bpe_tokenizer
from loomax.errors import DataSourceError

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "add(2, 3) = 5"},
    {"role": "user", "content": "Shout apple."},
    {"role": "assistant", "content": "upper(apple) = APPLE"},
]

# an HF-style template: a default system turn, loop controls, tojson, raise_exception,
# whitespace control and `{% generation %}` blocks, as templates on the Hub write them
HUB_TEMPLATE = """{%- if messages[0]['role'] != 'system' %}
{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message['role'] not in ['system', 'user', 'assistant'] %}
    {{- raise_exception('bad role ' + message['role'] | tojson) }}
  {%- endif %}
  {%- if message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}
  {%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tokenizer built here (no hub), saved by transformers with HUB_TEMPLATE."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("tok")
    texts = [json.dumps(CHAT)] * 4 + ["add upper reverse apple river " * 8]
    tok = train_bpe_tokenizer(texts, 300, out / "bpe.json")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, chat_template=HUB_TEMPLATE
    )
    fast.save_pretrained(out)
    return out, fast, tok


def _hf_ids(fast, messages, template=None):
    out = fast.apply_chat_template(messages, chat_template=template, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_same_ids_as_transformers_apply_chat_template(hf_dir):
    """The tokenizer folder's own chat_template (read from its tokenizer_config.json) and every
    shipped template give transformers' token ids."""
    out, fast, tok = hf_dir
    own = load_template(None, tok, out / "tokenizer.json")
    assert own.source == HUB_TEMPLATE and own.special["eos_token"] == EOS_TOKEN
    for messages in (CHAT, CHAT[1:], CHAT[:3]):
        ids, _ = encode_chat(messages, own, tok)
        assert list(ids) == _hf_ids(fast, messages)
        for name in SHIPPED:
            ids, _ = encode_chat(messages, load_template(name, tok, out / "tokenizer.json"), tok)
            assert list(ids) == _hf_ids(fast, messages, SHIPPED[name]), name


def test_assistant_mask_equals_transformers_generation_mask(hf_dir):
    """Where the template marks the assistant's tokens with `{% generation %}`, the mask from
    the message spans is transformers' `return_assistant_tokens_mask`."""
    out, fast, tok = hf_dir
    _, trained = encode_chat(CHAT, load_template(None, tok, out / "tokenizer.json"), tok)
    theirs = fast.apply_chat_template(
        CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )["assistant_masks"]
    assert trained.astype(int).tolist() == list(theirs)


def test_loss_on_modes_pick_the_turns(hf_dir):
    out, _, tok = hf_dir
    template = load_template("loomax", tok, out / "tokenizer.json")
    ids, every = encode_chat(CHAT, template, tok, "assistant")
    _, last = encode_chat(CHAT, template, tok, "last_assistant")
    _, all_ = encode_chat(CHAT, template, tok, "all")
    text = tok.decode(ids[every].tolist(), skip_special_tokens=False)
    assert text == "add(2, 3) = 5" + EOS_TOKEN + "\n" + "upper(apple) = APPLE" + EOS_TOKEN + "\n"
    assert (
        tok.decode(ids[last].tolist(), skip_special_tokens=False)
        == "upper(apple) = APPLE" + EOS_TOKEN + "\n"
    )
    assert all_.all() and (last <= every).all() and last.sum() < every.sum()


def test_spans_of_a_template_that_rewrites_earlier_turns_are_refused():
    changing = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}"
    with pytest.raises(DataSourceError, match="prefix"):
        message_spans(changing, CHAT, {})


def test_bad_conversations_name_the_place():
    with pytest.raises(DataSourceError, match=r"f.jsonl, line 3: turn 1 has no string `content`"):
        check_messages([{"role": "user", "content": "x"}, {"role": "assistant"}], "f.jsonl, line 3")
    with pytest.raises(DataSourceError, match="non-empty list"):
        check_messages([], "here")


def test_template_file_and_missing_template(tmp_path, hf_dir):
    out, _, tok = hf_dir
    (tmp_path / "t.jinja").write_text(SHIPPED["chatml"])
    assert (
        load_template(str(tmp_path / "t.jinja"), tok, out / "tokenizer.json").source
        == SHIPPED["chatml"]
    )
    with pytest.raises(FileNotFoundError, match="neither a shipped template"):
        load_template("nope", tok, out / "tokenizer.json")
    assert np.all(SHIPPED["loomax"])


def test_prompt_ids_are_transformers_generation_prompt(hf_dir, tmp_path):
    """`loomax generate --chat`'s prompt: the conversation with the generation prompt."""
    out, fast, tok = hf_dir
    question = CHAT[:2]
    theirs = fast.apply_chat_template(question, tokenize=True, add_generation_prompt=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    assert prompt_ids(question, load_template(None, tok, out / "tokenizer.json"), tok) == theirs
    (tmp_path / "c.json").write_text(json.dumps({"messages": question}))
    assert (
        read_chat_arg(str(tmp_path / "c.json")) == question == read_chat_arg(json.dumps(question))
    )
    with pytest.raises(DataSourceError, match="--chat: neither a file nor JSON"):
        read_chat_arg("{nope")
