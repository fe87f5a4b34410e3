"""Sampling from a language model: KV-cache decoding with temperature, top-k and top-p.

The prompt is run once through ``model.decode`` (filling the cache), then each new token
costs one single-position step. Both steps are jitted with fixed shapes, so a whole
sample compiles twice at most. ``use_cache=False`` reruns the model on the whole buffer
for every token (the reference the cache is tested against).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from loomax.models.axes import Position, Vocab
from loomax.models.config import LmModel


def pick_token(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    """One token id from ``[vocab]`` logits: argmax when ``temperature == 0``, else a sample
    from the softmax at ``temperature``, restricted to the ``top_k`` most likely tokens and to
    the smallest set whose probability reaches ``top_p``."""
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits)
    logits = logits / temperature
    neg = jnp.finfo(jnp.float32).min
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p is not None and top_p < 1.0:
        order = jnp.argsort(-logits)
        probs = jax.nn.softmax(logits[order])
        before = jnp.cumsum(probs) - probs  # mass of strictly more likely tokens
        keep_sorted = before < top_p
        keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
        logits = jnp.where(keep, logits, neg)
    return jax.random.categorical(key, logits)


def sample_tokens(
    model: LmModel,
    prompt: Sequence[int],
    *,
    seq_len: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    key: jax.Array,
    stop_token: int | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
) -> list[int]:
    """``prompt`` followed by up to ``max_new_tokens`` sampled tokens.

    Stops early at ``stop_token`` (included) or when ``seq_len`` positions are filled; a
    prompt longer than ``seq_len - 1`` keeps its last tokens. ``temperature == 0`` is greedy.
    """
    if not prompt:
        raise ValueError("sample_tokens needs a non-empty prompt")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    prompt = list(prompt)[-(seq_len - 1) :]
    buffer = np.zeros(seq_len, np.int32)
    buffer[: len(prompt)] = prompt
    options = (temperature, top_k, top_p)
    stop = min(seq_len, len(prompt) + max_new_tokens)
    steps = _cached_steps(*options) if use_cache else _full_steps(*options)
    state = steps.start(model, jnp.asarray(buffer), len(prompt))
    out = list(prompt)
    for pos in range(len(prompt), stop):
        key, step_key = jax.random.split(key)
        state, token = steps.next(model, state, jnp.asarray(pos), step_key)
        out.append(int(token))
        if stop_token is not None and out[-1] == stop_token:
            break
    return out


class _Steps:
    """``start(model, buffer, length) -> state`` and ``next(model, state, pos, key) -> (state, token)``."""

    def __init__(self, start, next):
        self.start, self.next = start, next


def _logits_at(model: LmModel, hidden, index) -> jax.Array:
    h = hidden[Position, index]
    return hax.dot(h, model.lm_head_weight(), axis="embed").rearrange((Vocab,)).array


@functools.lru_cache(maxsize=16)  # same options, same jitted steps: no recompiling per sample
def _full_steps(temperature, top_k, top_p) -> _Steps:
    """No cache: ``state`` is the token buffer; every step reruns the model on all of it."""
    options = {"temperature": temperature, "top_k": top_k, "top_p": top_p}

    @jax.jit
    def next_token(model, tokens, pos, key):
        hidden = model.hidden_states(hax.named(tokens, Position))
        token = pick_token(_logits_at(model, hidden, pos - 1), key, **options).astype(jnp.int32)
        return tokens.at[pos].set(token), token

    return _Steps(lambda model, tokens, length: tokens, next_token)


@functools.lru_cache(maxsize=16)
def _cached_steps(temperature, top_k, top_p) -> _Steps:
    """KV cache: ``state`` is ``(cache, logits of the last position)``; one prefill call."""
    options = {"temperature": temperature, "top_k": top_k, "top_p": top_p}

    @jax.jit
    def prefill(model, tokens, length):
        cache = model.init_cache((), tokens.shape[0], model.lm_head_weight().dtype)
        hidden, cache = model.decode(hax.named(tokens, Position), cache, jnp.asarray(0))
        return cache, _logits_at(model, hidden, length - 1)

    @jax.jit
    def next_token(model, state, pos, key):
        cache, logits = state
        token = pick_token(logits, key, **options).astype(jnp.int32)
        hidden, cache = model.decode(hax.named(token[None], Position), cache, pos)
        return (cache, _logits_at(model, hidden, 0)), token

    return _Steps(
        lambda model, tokens, length: prefill(model, tokens, jnp.asarray(length)), next_token
    )
