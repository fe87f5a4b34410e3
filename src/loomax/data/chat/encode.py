"""A conversation as token ids and a per-token loss mask."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from loomax.data.chat.render import message_spans, render
from loomax.data.chat.templates import SHIPPED
from loomax.data.tokenizer import BOS_CANDIDATES, EOS_CANDIDATES
from loomax.errors import DataSourceError, MissingFileError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
"""The special tokens transformers hands a chat template (by their names in tokenizer_config.json)."""

JINJA_FILE = "chat_template.jinja"
"""Where transformers 5 saves a tokenizer's chat template, beside tokenizer_config.json."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's text and the special tokens it sees."""

    source: str
    special: dict[str, str]
    name: str = ""


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json stores it
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataSourceError(f"data.chat.template: {path} is not readable JSON ({e})") from e


def _from_config_file(path: Path) -> ChatTemplate:
    """A tokenizer_config.json's template: its `chat_template`, or (transformers 5 saves it
    apart) the `chat_template.jinja` beside it, with its special tokens."""
    config = _read_config(path)
    source = config.get("chat_template")
    if source is None and (path.parent / JINJA_FILE).is_file():
        source = (path.parent / JINJA_FILE).read_text()
    if isinstance(source, list):  # named templates: transformers' default is "default"
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise DataSourceError(f"data.chat.template: {path} has no `chat_template` string")
    return ChatTemplate(source, _config_special(config), str(path))


def _config_special(config: dict) -> dict[str, str]:
    """The special tokens a tokenizer_config.json names (what transformers hands a template)."""
    return {k: t for k in SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}


def _own_special(tokenizer: Tokenizer) -> dict[str, str]:
    """BOS/EOS of a tokenizer.json without a config: the first of the known names it has; a
    tokenizer without a BOS (Loomax's own) uses its EOS there, as its Hugging Face export
    says (``loomax.hf.special_token_ids``), so the export renders the same ids."""
    found = {}
    for key, names in (("eos_token", EOS_CANDIDATES), ("bos_token", BOS_CANDIDATES)):
        name = next((n for n in names if tokenizer.token_to_id(n) is not None), None)
        found[key] = name or found.get("eos_token", "")
    return found


def folder_template(tokenizer_path: str | Path) -> ChatTemplate | None:
    """The template of a tokenizer's folder (its tokenizer_config.json's `chat_template`, or
    the `chat_template.jinja` beside it); None without one."""
    folder = Path(tokenizer_path).parent
    beside = folder / "tokenizer_config.json"
    if beside.is_file() and (
        "chat_template" in _read_config(beside) or (folder / JINJA_FILE).is_file()
    ):
        return _from_config_file(beside)
    return None


def load_template(
    spec: str | None, tokenizer: Tokenizer, tokenizer_path: str | Path
) -> ChatTemplate:
    """The template ``data.chat.template`` names (see ``ChatConfig.template``)."""
    folder = Path(tokenizer_path).parent
    beside = folder / "tokenizer_config.json"
    if spec is None:
        own = folder_template(tokenizer_path)
        if own is not None:
            return own
        spec = "loomax"
    # the special tokens transformers would give the template: the folder's config's, if any
    special = _config_special(_read_config(beside)) if beside.is_file() else None
    special = _own_special(tokenizer) if special is None else special
    if spec in SHIPPED:
        return ChatTemplate(SHIPPED[spec], special, spec)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise MissingFileError(
            f"data.chat.template: {spec!r} is neither a shipped template "
            f"({', '.join(SHIPPED)}) nor a file"
        )
    if path.suffix == ".json":
        return _from_config_file(path)
    return ChatTemplate(path.read_text(), special, str(path))


def encode_chat(
    messages: list[dict], template: ChatTemplate, tokenizer: Tokenizer, loss_on: str = "assistant"
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, trained)``: the conversation's token ids (the rendered text encoded without
    added special tokens, as ``apply_chat_template(tokenize=True)``) and, per token, whether
    the loss covers it (``loss_on``: assistant | last_assistant | all). A token belongs to
    the message whose characters hold its first character."""
    text, spans = message_spans(template.source, messages, template.special)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int32)
    if loss_on == "all":
        return ids, np.ones(len(ids), dtype=bool)
    chosen = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if loss_on == "last_assistant":
        chosen = chosen[-1:]
    starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    for i in chosen:
        lo, hi = spans[i]
        trained |= (starts >= lo) & (starts < hi)
    return ids, trained


def prompt_ids(messages: list[dict], template: ChatTemplate, tokenizer: Tokenizer) -> list[int]:
    """The ids a model continues to answer ``messages``: the conversation rendered with the
    generation prompt, as ``apply_chat_template(add_generation_prompt=True, tokenize=True)``."""
    text = render(template.source, messages, template.special, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False).ids


def read_chat_arg(value: str) -> list[dict]:
    """A conversation given on the command line: JSON (a list of turns, or an object with
    `messages`), or a file holding it."""
    try:
        text = Path(value).read_text() if Path(value).is_file() else value
    except OSError:  # a long JSON string is no file name
        text = value
    try:
        data = json.loads(text)
    except ValueError as e:
        raise DataSourceError(f"--chat: neither a file nor JSON ({e})") from e
    return check_messages(data.get("messages") if isinstance(data, dict) else data, "--chat")


def check_messages(messages, where: str) -> list[dict]:
    """``messages`` as a list of {role, content} dicts, or one error naming ``where``."""
    if not isinstance(messages, list) or not messages:
        raise DataSourceError(f"{where}: `messages` must be a non-empty list of turns")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataSourceError(f"{where}: turn {i} has no string `role`")
        if not isinstance(m.get("content"), str):
            raise DataSourceError(f"{where}: turn {i} has no string `content`")
    return messages
