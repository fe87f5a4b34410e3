"""Sampling from a language model: KV-cache decoding with temperature, top-k and top-p.

The prompt is run once through ``model.decode`` (filling the cache), then each new token
costs one single-position step. Both steps are jitted with fixed shapes, so a whole
sample compiles twice at most. ``use_cache=False`` reruns the model on the whole buffer
for every token (the reference the cache is tested against). ``sample_batch`` decodes
several prompts together, each row at its own position (the steps vmapped over rows).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from loomax.models.axes import Position, Vocab
from loomax.models.config import LmModel, soft_cap
from loomax.models.decoding.kind_cache import KindCache, init_kind_cache, rolled, uses_kinds
from loomax.models.decoding.rolling_cache import to_rolling
from loomax.models.decoding.split_prefill import (
    check_splittable,
    context_split,
    on_mesh,
    prompt_prefill,
    weights_mesh,
)


def pick_token(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    seen: jax.Array | None = None,
) -> jax.Array:
    """One token id from ``[vocab]`` logits: argmax when ``temperature == 0``, else a sample
    from the softmax at ``temperature``, restricted to the ``top_k`` most likely tokens and to
    the smallest set whose probability reaches ``top_p``. With ``repetition_penalty`` p, the
    logits of the ``seen`` tokens (a ``[vocab]`` mask) are divided by p where positive and
    multiplied by p where negative (CTRL's penalty), before anything else."""
    logits = logits.astype(jnp.float32)
    if repetition_penalty is not None and seen is not None:
        penalised = jnp.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = jnp.where(seen, penalised, logits)
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


def _check_options(temperature, top_k, top_p, repetition_penalty=None) -> None:
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


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
    repetition_penalty: float | None = None,
    use_cache: bool = True,
    mesh: Mesh | None = None,
) -> list[int]:
    """``prompt`` followed by up to ``max_new_tokens`` sampled tokens.

    Stops early at ``stop_token`` (included) or when ``seq_len`` positions are filled; a
    prompt longer than ``seq_len - 1`` keeps its last tokens. ``temperature == 0`` is greedy.
    When ``mesh`` (default: the mesh the model's weights lie on) has a ``context`` axis of
    size n > 1, the prompt is prefilled split over it, the cache being the whole buffer
    (``seq_len`` rounded up to a multiple of 2n), and decoding reads that cache where it
    lies (``models/decoding/split_prefill.py``); ``use_cache=False`` never splits.
    """
    if not prompt:
        raise ValueError("sample_tokens needs a non-empty prompt")
    _check_options(temperature, top_k, top_p, repetition_penalty)
    prompt = list(prompt)[-(seq_len - 1) :]
    buffer = np.zeros(seq_len, np.int32)
    buffer[: len(prompt)] = prompt
    options = (temperature, top_k, top_p, repetition_penalty)
    stop = min(seq_len, len(prompt) + max_new_tokens)
    steps = _cached_steps(*options) if use_cache else _full_steps(*options)
    mesh = weights_mesh(model) if mesh is None else mesh
    if use_cache and context_split(mesh) > 1:
        check_splittable(model)
        model, steps = on_mesh(model, mesh), _split_steps(mesh, *options)
    with hax.axis_mapping({}):  # decoding never splits the position axis
        state = steps.start(model, jnp.asarray(buffer), len(prompt))
        out = list(prompt)
        for pos in range(len(prompt), stop):
            key, step_key = jax.random.split(key)
            state, token = steps.next(model, state, jnp.asarray(pos), step_key)
            out.append(int(token))
            if stop_token is not None and out[-1] == stop_token:
                break
    return out


def sample_batch(
    model: LmModel,
    prompts: Sequence[Sequence[int]],
    *,
    seq_len: int,
    max_new_tokens: int,
    keys: jax.Array,
    temperature: float = 1.0,
    stop_token: int | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    rows: int | None = None,
) -> list[list[int]]:
    """``sample_tokens`` of each prompt (row ``i`` with ``keys[i]``), decoded together: one
    prefill and one step per new token for all rows, each row at its own position and
    stopping on its own. ``rows`` pads the batch to a fixed size (one compile for batches
    of any size up to it). A model with a recurrent state (``recurrent_state``: Qwen3-Next's
    DeltaNet layers) prefills at the prompts' exact length; prompts of unequal lengths then
    decode one at a time (``sample_tokens``), as padding would enter the state."""
    if not prompts or not all(prompts):
        raise ValueError("sample_batch needs non-empty prompts")
    _check_options(temperature, top_k, top_p, repetition_penalty)
    rows = max(rows or len(prompts), len(prompts))
    prompts = [list(p)[-(seq_len - 1) :] for p in prompts]
    recurrent = getattr(model, "recurrent_state", False)  # padding would enter its state
    if recurrent and len({len(p) for p in prompts}) > 1:  # prompts of unequal length: one by one
        options = dict(temperature=temperature, stop_token=stop_token, top_k=top_k, top_p=top_p,
                       repetition_penalty=repetition_penalty)  # fmt: skip
        return [
            sample_tokens(
                model, p, seq_len=seq_len, max_new_tokens=max_new_tokens, key=k, **options
            )
            for p, k in zip(prompts, keys, strict=False)
        ]
    buffer = np.zeros((rows, seq_len), np.int32)
    length = np.ones(rows, np.int32)  # padding rows: a one-token prompt, results dropped
    for i, prompt in enumerate(prompts):
        buffer[i, : len(prompt)], length[i] = prompt, len(prompt)
    keys = jnp.concatenate([keys, jnp.repeat(keys[:1], rows - len(prompts), axis=0)])
    start, next_token = _batched_steps(temperature, top_k, top_p, repetition_penalty, seq_len)
    width = int(length.max()) if recurrent else prompt_bucket(int(length.max()), seq_len)
    with hax.axis_mapping({}):  # rows decoded whole (no context split here)
        state = start(model, jnp.asarray(buffer[:, :width]), jnp.asarray(length))
    out = [list(p) for p in prompts]
    stop = [min(seq_len, len(p) + max_new_tokens) for p in prompts]
    live = [len(p) < s for p, s in zip(prompts, stop, strict=True)]
    pos = length.copy()
    while any(live):
        keys, step_keys = _split_rows(keys)
        with hax.axis_mapping({}):
            state, tokens = next_token(model, state, jnp.asarray(pos), step_keys)
        tokens = np.asarray(tokens)
        for i in (i for i, alive in enumerate(live) if alive):
            out[i].append(int(tokens[i]))
            live[i] = len(out[i]) < stop[i] and out[i][-1] != stop_token
        pos = np.minimum(pos + 1, seq_len - 1)
    return out


@jax.jit
def _split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    pairs = jax.vmap(jax.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]


@functools.lru_cache(maxsize=16)
def _batched_steps(temperature, top_k, top_p, repetition_penalty, cache_len):
    """``_cached_steps``' two steps vmapped over rows (the model shared, positions per row)."""
    steps = _cached_steps(temperature, top_k, top_p, repetition_penalty)

    def prefill_row(model, tokens, length):
        return steps.prefill(model, tokens, length, cache_len)

    prefill = jax.jit(jax.vmap(prefill_row, in_axes=(None, 0, 0)))
    next_token = jax.jit(jax.vmap(steps.next, in_axes=(None, 0, 0, 0)), donate_argnums=1)
    return prefill, next_token


class _Steps:
    """``start(model, buffer, length) -> state`` and ``next(model, state, pos, key) -> (state, token)``."""

    def __init__(self, start, next, prefill=None):
        self.start, self.next, self.prefill = start, next, prefill


def _logits_at(model: LmModel, hidden, index) -> jax.Array:
    return _head(model, hidden[Position, index])


def _head(model: LmModel, h) -> jax.Array:
    """``[vocab]`` logits of one final hidden state ``h`` (axis ``embed``)."""
    logits = hax.dot(h, model.lm_head_weight(), axis="embed").rearrange((Vocab,)).array
    return soft_cap(logits, model.final_logit_softcap)


@functools.lru_cache(maxsize=16)  # same options, same jitted steps: no recompiling per sample
def _full_steps(temperature, top_k, top_p, repetition_penalty) -> _Steps:
    """No cache: ``state`` is the token buffer; every step reruns the model on all of it."""
    options = _options(temperature, top_k, top_p, repetition_penalty)

    @jax.jit
    def next_token(model, tokens, pos, key):
        hidden = model.hidden_states(hax.named(tokens, Position))
        seen = _seen(tokens, pos, model.Vocab.size)
        logits = _logits_at(model, hidden, pos - 1)
        token = pick_token(logits, key, seen=seen, **options).astype(jnp.int32)
        return tokens.at[pos].set(token), token

    return _Steps(lambda model, tokens, length: tokens, next_token)


def _options(temperature, top_k, top_p, repetition_penalty) -> dict:
    return {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "repetition_penalty": repetition_penalty,
    }


def _seen(tokens: jax.Array, length, vocab: int) -> jax.Array:
    """``[vocab]`` mask of the token ids among ``tokens[:length]``."""
    present = jnp.arange(tokens.shape[0]) < length
    return jnp.zeros(vocab, bool).at[tokens].max(present)


def prompt_bucket(length: int, seq_len: int) -> int:
    """The prefill width for a prompt of ``length`` tokens: the next power of two (at least
    16, at most ``seq_len``), so prompts share a few compiles and a short prompt does not pay
    for the whole buffer."""
    return min(seq_len, max(16, 1 << max(0, length - 1).bit_length()))


@functools.lru_cache(maxsize=16)
def _cached_steps(temperature, top_k, top_p, repetition_penalty) -> _Steps:
    """KV cache: ``state`` is ``(cache, logits of the last position, tokens seen)``; one
    prefill call over the prompt's bucket (``prompt_bucket``) into a cache of the buffer's
    length, or of the window when every layer shares one, or per kind of layer where the
    windows differ (``models/decoding/kind_cache.py``)."""
    options = _options(temperature, top_k, top_p, repetition_penalty)

    @functools.partial(jax.jit, static_argnums=3)
    def prefill(model, tokens, length, cache_len):
        # a window all layers share: the prompt into a cache of its bucket, then its last
        # window of positions into a window-sized rolling cache (models.rolling_cache);
        # windows that differ: so for each windowed kind of layer (models.kind_cache)
        window, dtype = model.cache_window(), model.lm_head_weight().dtype
        rolling = window is not None and window < cache_len
        size = tokens.shape[0] if rolling else cache_len
        if uses_kinds(model, cache_len):
            cache = init_kind_cache(model, (), cache_len, dtype, local_len=tokens.shape[0])
        else:
            cache = model.init_cache((), size, dtype)
        hidden, cache = model.decode(hax.named(tokens, Position), cache, jnp.asarray(0))
        if rolling:
            cache = to_rolling(cache, length, window)
        elif isinstance(cache, KindCache):
            cache = rolled(cache, length)
        seen = _seen(tokens, length, model.Vocab.size)
        return cache, _logits_at(model, hidden, length - 1), seen

    @jax.jit
    def next_token(model, state, pos, key):
        cache, logits, seen = state
        token = pick_token(logits, key, seen=seen, **options).astype(jnp.int32)
        hidden, cache = model.decode(hax.named(token[None], Position), cache, pos)
        return (cache, _logits_at(model, hidden, 0), seen.at[token].set(True)), token

    def start(model, tokens, length):
        width = prompt_bucket(length, tokens.shape[0])
        if getattr(model, "recurrent_state", False):  # a state would absorb the padding
            width = length
        return prefill(model, tokens[:width], jnp.asarray(length), tokens.shape[0])

    return _Steps(start, next_token, prefill)


@functools.lru_cache(maxsize=8)
def _split_steps(mesh, temperature, top_k, top_p, repetition_penalty) -> _Steps:
    """``_cached_steps`` with the prompt prefilled split over ``mesh``'s context axis
    (``models/decoding/split_prefill.prompt_prefill``); the steps read the cache where it lies."""
    steps, prefill = (
        _cached_steps(temperature, top_k, top_p, repetition_penalty),
        prompt_prefill(mesh),
    )
    seen, head = jax.jit(_seen, static_argnums=2), jax.jit(_head)

    def start(model, tokens, length):
        cache, hidden = prefill(model, tokens, length)
        logits = head(model, hidden)
        return cache, logits, seen(tokens, jnp.asarray(length), model.Vocab.size)

    return _Steps(start, steps.next)
