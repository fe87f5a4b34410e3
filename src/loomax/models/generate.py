"""Sampling from a language model: temperature (or greedy) decoding, one jitted step per token."""

from __future__ import annotations

from collections.abc import Sequence

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from loomax.models.axes import Position, Vocab
from loomax.models.config import LmModel


def sample_tokens(
    model: LmModel,
    prompt: Sequence[int],
    *,
    seq_len: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    key: jax.Array,
    stop_token: int | None = None,
) -> list[int]:
    """``prompt`` followed by up to ``max_new_tokens`` sampled tokens (fewer if ``seq_len`` is reached).

    ``temperature == 0`` is greedy decoding. Each token reruns the model on a fixed
    ``seq_len`` buffer, so the step compiles once; fine for short samples (no KV cache).
    """
    if not prompt:
        raise ValueError("sample_tokens needs a non-empty prompt")
    prompt = list(prompt)[-(seq_len - 1) :]
    buffer = np.zeros(seq_len, np.int32)
    buffer[: len(prompt)] = prompt
    tokens = jnp.asarray(buffer)

    @jax.jit
    def next_token(model, tokens, pos, key):
        logits = (
            model.logits(hax.named(tokens, Position))[Position, pos - 1].rearrange((Vocab,)).array
        )
        logits = logits.astype(jnp.float32)
        if temperature == 0:
            token = jnp.argmax(logits)
        else:
            token = jax.random.categorical(key, logits / temperature)
        return tokens.at[pos].set(token.astype(jnp.int32)), token

    out = list(prompt)
    for pos in range(len(prompt), min(seq_len, len(prompt) + max_new_tokens)):
        key, step_key = jax.random.split(key)
        tokens, token = next_token(model, tokens, jnp.asarray(pos), step_key)
        out.append(int(token))
        if stop_token is not None and out[-1] == stop_token:
            break
    return out
