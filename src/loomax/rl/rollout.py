"""Rollouts: many prompts decoded at once with the KV cache, on the training mesh.

``generate`` takes the policy as the trainer holds it (its weights where they lie on the
mesh: no copy, no transfer), places the prompt rows on the mesh's data axes and runs one
compiled program: a prefill of every row's prompt (``models.decoding``' cached steps,
vmapped over rows), then a ``while`` loop of single-token steps until every row has hit its
stop token or its length limit. Row ``i`` samples with its own key (``row_keys``), so the
samples do not depend on how the rows are split over devices. Each sampled token's log-prob
under the sampling distribution (``temperature``, before top-p) is kept.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from loomax.mesh import batch_sharding
from loomax.models.decoding.generate import _cached_steps, _check_options, prompt_bucket


@dataclass(frozen=True)
class Rollouts:
    """Sampled rows: ``tokens[i, :length[i]]`` is prompt ``i`` then its completion."""

    tokens: np.ndarray
    """``[rows, seq_len]`` int32: prompt, completion (its stop token included), then zeros."""
    prompt_len: np.ndarray
    """``[rows]``: the prompt's tokens."""
    length: np.ndarray
    """``[rows]``: prompt and completion tokens."""
    logp: np.ndarray
    """``[rows, seq_len]``: the sampler's log-prob of the token at each completion position (0 elsewhere)."""
    seconds: float
    """Wall time of the generation (compile included on a first call)."""

    def completion(self, i: int) -> list[int]:
        """Row ``i``'s sampled tokens."""
        return self.tokens[i, self.prompt_len[i] : self.length[i]].tolist()

    @property
    def new_tokens(self) -> int:
        """Tokens sampled over all rows."""
        return int(np.sum(self.length - self.prompt_len))


def row_keys(key: jax.Array, rows: int) -> jax.Array:
    """``[rows, 2]`` keys: ``fold_in(key, i)`` for row ``i`` (independent of the devices)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(rows))


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    keys: jax.Array,
    *,
    seq_len: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float | None = None,
    stop_token: int | None = None,
    mesh: Mesh | None = None,
) -> Rollouts:
    """Sample a completion of each prompt (row ``i`` with ``keys[i]``), all rows together.

    A prompt longer than ``seq_len - 1`` keeps its last tokens; a row stops after its
    ``stop_token`` or ``max_new_tokens`` or at ``seq_len``. With ``mesh`` the rows are split
    over its data axes (their number must divide evenly)."""
    if not prompts or not all(prompts):
        raise ValueError("generate needs non-empty prompts")
    _check_options(temperature, None, top_p)
    rows = len(prompts)
    prompts = [list(p)[-(seq_len - 1) :] for p in prompts]
    buffer = np.zeros((rows, seq_len), np.int32)
    length = np.zeros(rows, np.int32)
    for i, p in enumerate(prompts):
        buffer[i, : len(p)], length[i] = p, len(p)
    width = prompt_bucket(int(length.max()), seq_len)
    run = _program(temperature, top_p, -1 if stop_token is None else stop_token, seq_len, width,
                   max_new_tokens)  # fmt: skip
    args = (jnp.asarray(buffer), jnp.asarray(length), jnp.asarray(keys))
    if mesh is not None:
        args = tuple(jax.device_put(a, batch_sharding(mesh, a.ndim)) for a in args)
    started = time.perf_counter()
    with hax.axis_mapping({}):  # rows decoded whole; the batch split comes from the inputs
        tokens, logp, end = run(model, *args)
    tokens, logp, end = np.asarray(tokens), np.asarray(logp), np.asarray(end)
    return Rollouts(tokens, length, end, logp, time.perf_counter() - started)


@functools.lru_cache(maxsize=16)
def _program(temperature, top_p, stop_token, seq_len, width, max_new_tokens):
    """The jitted rollout for these options and shapes."""
    steps = _cached_steps(temperature, None, top_p, None)
    next_rows = jax.vmap(steps.next, in_axes=(None, 0, 0, 0))

    @jax.jit
    def run(model, buffer, length, keys):
        rows = buffer.shape[0]
        prefill = jax.vmap(lambda t, n: steps.prefill(model, t[:width], n, seq_len))
        state = prefill(buffer, length)
        limit = jnp.minimum(length + max_new_tokens, seq_len)
        index = jnp.arange(rows)

        def cond(carry):
            i, _, _, _, done, _, _ = carry
            return (i < max_new_tokens) & ~jnp.all(done)

        def body(carry):
            i, state, buffer, logps, done, pos, keys = carry
            pairs = jax.vmap(jax.random.split)(keys)
            keys, step_keys = pairs[:, 0], pairs[:, 1]
            logits = state[1].astype(jnp.float32)
            at = jnp.minimum(pos, seq_len - 1)
            state, token = next_rows(model, state, at, step_keys)
            scaled = logits / temperature if temperature > 0 else logits
            lp = jnp.take_along_axis(jax.nn.log_softmax(scaled, -1), token[:, None], -1)[:, 0]
            buffer = buffer.at[index, at].set(jnp.where(done, buffer[index, at], token))
            logps = logps.at[index, at].set(jnp.where(done, logps[index, at], lp))
            stopped = (token == stop_token) | (pos + 1 >= limit)
            pos = jnp.where(done, pos, pos + 1)
            return i + 1, state, buffer, logps, done | stopped, pos, keys

        done = length >= limit
        logps = jnp.zeros(buffer.shape, jnp.float32)
        carry = (jnp.asarray(0), state, buffer, logps, done, length, keys)
        _, _, buffer, logps, _, pos, _ = jax.lax.while_loop(cond, body, carry)
        return buffer, logps, pos

    return run


__all__ = ["Rollouts", "generate", "row_keys"]
