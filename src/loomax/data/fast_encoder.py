"""An exact fast encoder for byte-level BPE tokenizers: tiktoken run on the tokenizer's own vocab.

tiktoken encodes GPT-2-style byte-level BPE several times faster than `tokenizers`'
`encode_batch_fast`, but it merges by token id (the lowest id whose bytes two neighbours
make), where Hugging Face merges by the order of the `merges` list, and it takes a whole
pre-token found in the vocab as one token. `fast_encoder` converts a loaded tokenizer only
when its tokenizer.json shows the two give the same ids for every text:

- a BPE model under a lone ByteLevel pre-tokenizer (GPT-2's split regex, no prefix space),
  no normalizer, a post-processor that adds no tokens (none or ByteLevel), no truncation or
  padding, no dropout, subword prefix or suffix, byte fallback, every byte in the vocab;
- merge `k`'s result has a larger id than merge `k-1`'s, every longer token is the result
  of exactly one merge, and every token's own bytes BPE-encode to that token alone. Then,
  at each step, a pair of neighbours whose bytes make a token is that token's merge (its
  bytes were merged as when encoded alone, which ends in that one merge), so tiktoken's
  lowest id is Hugging Face's first merge, leftmost on ties in both;
- added tokens as Hugging Face splits them out of the text: not normalized, no strip or
  single-word rule, none a prefix of another (so leftmost-longest and tiktoken's match
  agree), none a merge result.

A last check encodes a probe text (many scripts, digits, spaces, added tokens) both ways.
Otherwise `fast_encoder` returns None and says why once, at debug level.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""The split regex of Hugging Face's ByteLevel pre-tokenizer (`use_regex: true`), GPT-2's."""

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""Text `tokenizers` refuses (TypeError) and tiktoken would encode as U+FFFD."""

_PROBE = (
    "Hello, World! It's we'll they'd I'M don't 'S 12345 3.14 ١٢٣ ⅷ x²\n\n  \t\tend   "
    "naïve café Ünïcödé ß ǅ ΑΒΓ αβγ Привет мир שלום مرحبا नमस्ते ภาษาไทย 한국어 日本語の"
    'テキスト 数据集 🙂👍🏽🇫🇷 👨‍👩‍👧 \u200b\u00a0\u3000\x85\x0b\x0c\u2028\u1680 ~!@#$%^&*()_+-=[]{}|;:",.<>/? \r\n'
)


@functools.cache
def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, shifted = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


class FastEncoder:
    """Encodes texts with tiktoken exactly as the tokenizer it was made from does."""

    def __init__(self, encoding: Any, fallback: Tokenizer) -> None:
        self._encoding = encoding
        self._fallback = fallback

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, added tokens split out (what `encode_batch_fast` gives)."""
        if any(not t.isascii() and _LONE_SURROGATE.search(t) for t in texts):  # HF's error
            return [e.ids for e in self._fallback.encode_batch_fast(list(texts))]
        threads = int(os.environ.get("RAYON_NUM_THREADS") or os.cpu_count() or 1)
        if threads <= 1 or len(texts) < 2:
            return [self._encoding.encode(text, allowed_special="all") for text in texts]
        return self._encoding.encode_batch(list(texts), num_threads=threads, allowed_special="all")


def fast_encoder(tokenizer: Tokenizer) -> FastEncoder | None:
    """An exact tiktoken encoder for `tokenizer`, or None (why, logged once) if not provably exact."""
    return _converted(tokenizer.to_str(), tokenizer.encode_special_tokens)


@functools.lru_cache(maxsize=4)
def _converted(spec_text: str, encode_special: bool) -> FastEncoder | None:
    spec, tokenizer = json.loads(spec_text), Tokenizer.from_str(spec_text)
    reason = "encode_special_tokens is on" if encode_special else refusal(spec)
    encoder = None
    if reason is None:
        encoder = FastEncoder(_encoding(spec), tokenizer)
        probe = [_PROBE + "".join(t["content"] + _PROBE for t in spec["added_tokens"]), ""]
        if encoder.encode_batch(probe) != [e.ids for e in tokenizer.encode_batch_fast(probe)]:
            reason, encoder = "tiktoken's ids differ from the tokenizer's on the probe text", None
    if reason is not None:
        logger.debug("fast encoder off (data.fast_encoder), encode_batch_fast used: %s", reason)
    return encoder


def _encoding(spec: dict[str, Any]) -> Any:
    import tiktoken

    chars = _byte_chars()
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    ranks = {
        bytes(chars[c] for c in token): i
        for token, i in spec["model"]["vocab"].items()
        if token not in added
    }
    return tiktoken.Encoding(
        "loomax-fast", pat_str=GPT2_SPLIT, mergeable_ranks=ranks, special_tokens=added
    )


def refusal(spec: dict[str, Any]) -> str | None:
    """Why tiktoken may not give a tokenizer.json's ids (see the module doc); None if it does."""
    return _pipeline_refusal(spec) or _added_refusal(spec) or _merges_refusal(spec)


def _pipeline_refusal(spec: dict[str, Any]) -> str | None:
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        return f"model is {model.get('type')}, not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(key):
            return f"model.{key} is {model[key]!r}"
    if spec.get("normalizer") is not None:
        return f"it has a normalizer ({spec['normalizer'].get('type')})"
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        return f"pre_tokenizer is {pre.get('type')}, not ByteLevel with use_regex"
    if pre.get("add_prefix_space"):
        return "pre_tokenizer.add_prefix_space is true"
    post = spec.get("post_processor")
    if post is not None and post.get("type") != "ByteLevel":
        return f"post_processor {post.get('type')} may add tokens"
    if spec.get("truncation") or spec.get("padding"):
        return "truncation or padding is set"
    return None


def _added_refusal(spec: dict[str, Any]) -> str | None:
    contents = [t["content"] for t in spec.get("added_tokens", [])]
    for token in spec.get("added_tokens", []):
        rules = [k for k in ("normalized", "lstrip", "rstrip", "single_word") if token.get(k)]
        if rules or len(token["content"]) < 2:
            return f"added token {token['content']!r} has {rules or 'under 2 characters'}"
        if any(o != token["content"] and o.startswith(token["content"]) for o in contents):
            return f"added token {token['content']!r} is a prefix of another"
    return None


def _merges_refusal(spec: dict[str, Any]) -> str | None:
    vocab: dict[str, int] = spec["model"]["vocab"]
    added = {t["content"] for t in spec.get("added_tokens", [])}
    chars = _byte_chars()
    if missing := [c for c in chars if c not in vocab]:
        return f"{len(missing)} of the 256 byte tokens are not in the vocab"
    ranks: dict[tuple[str, str], int] = {}
    made: dict[str, int] = {}
    last_id = -1
    for k, merge in enumerate(spec["model"]["merges"]):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        result = left + right
        if result in made or result in added or vocab.get(result, -1) <= last_id:
            return f"merge {k} ({left!r}, {right!r}) makes a token twice, out of id order or not in the vocab"
        ranks[left, right], made[result], last_id = k, k, vocab[result]
    for token in vocab:
        if token in added or len(token) == 1:
            continue
        if token not in made or any(c not in chars for c in token):
            return f"vocab token {token!r} is not the result of a merge of byte-level tokens"
        if _merge(token, ranks) != [token]:
            return f"vocab token {token!r} does not BPE-encode to itself"
    return None


def _merge(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Hugging Face's BPE of one word: apply the lowest-ranked merge (leftmost on ties) until none."""
    parts = list(word)
    while len(parts) > 1:
        pairs = [ranks.get(pair, len(ranks)) for pair in zip(parts, parts[1:], strict=False)]
        best = min(range(len(pairs)), key=pairs.__getitem__)
        if pairs[best] == len(ranks):
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts
