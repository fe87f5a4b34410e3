"""``LoomaxLM``: an lm-eval ``LM`` backed by a Loomax model and its ``tokenizers`` tokenizer.

Importing this module imports ``lm_eval`` (the ``eval`` extra); a missing package is a
``MissingPackageError`` naming the extra. ``loomax.downstream.lm_eval_model`` imports it
only when called, so ``import loomax`` never needs lm-eval.

- ``loglikelihood``: lm-eval's own tokenization of ``(context, continuation)`` pairs (as
  its ``hf`` backend: the context's trailing spaces move to the continuation, an empty
  context is the end-of-text token), then ``Scorer`` (packed, jitted once per shape).
- ``loglikelihood_rolling``: the document in windows of ``seq_len`` tokens (lm-eval's
  ``get_rolling_token_windows``, each token predicted once), summed.
- ``generate_until``: KV-cache sampling (greedy unless the task asks for
  ``do_sample``/``temperature``) up to ``max_gen_toks`` tokens or end-of-text, cut at the
  first stop string; requests with the same generation options decode ``batch_size`` rows
  at a time (``sample_batch``), each row with its own key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loomax.errors import MissingPackageError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - exercised without the extra
    raise MissingPackageError(
        "downstream evaluation needs the `lm-eval` package, which is not installed: "
        "pip install 'loomax[eval]'"
    ) from e

import jax
import numpy as np
from tokenizers import Tokenizer

from loomax.data.tokenizer import eos_id, load_tokenizer
from loomax.downstream.scoring import Scorer
from loomax.models.config import LmModel
from loomax.models.decoding.generate import sample_batch

DEFAULT_MAX_GEN_TOKS = 256


class LoomaxLM(TemplateLM):
    """lm-eval's view of a Loomax model (see the module docstring)."""

    backend = "causal"

    def __init__(
        self,
        model: LmModel,
        tokenizer: Tokenizer | str | Path,
        *,
        batch_size: int = 8,
        seq_len: int | None = None,
        pack: bool | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        seed: int = 0,
    ):
        super().__init__()
        self.model = model
        self.tokenizer = (
            tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        )
        self.scorer = Scorer(model, batch_size=batch_size, seq_len=seq_len, pack=pack)
        self.max_gen_toks = max_gen_toks
        self._eot = eos_id(self.tokenizer)
        self._key = jax.random.PRNGKey(seed)

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self.scorer.seq_len

    @property
    def tokenizer_name(self) -> str:
        return "loomax"

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        special = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        results = self.scorer.score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for window in get_rolling_token_windows(
                tokens, self.prefix_token_id, max_seq_len=self.max_length, context_len=1
            ):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        scores = self.scorer.score(windows)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores, strict=True):
            totals[i] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        keys = jax.random.split(self._key, len(requests) + 1)
        self._key = keys[0]
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(_generation_options(req.args[1], self.max_gen_toks), []).append(i)
        out: list[str] = [""] * len(requests)
        size = self.scorer.batch_size
        for (until, max_new, temperature), members in groups.items():
            for first in range(0, len(members), size):
                batch = members[first : first + size]
                room = max(1, self.max_length - max_new)
                prompts = [
                    (self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-room:]
                    for i in batch
                ]
                samples = sample_batch(
                    self.model,
                    prompts,
                    seq_len=self.max_length,
                    max_new_tokens=max_new,
                    keys=keys[1:][np.asarray(batch)],
                    temperature=temperature,
                    stop_token=self._eot,
                    rows=size,
                )
                for i, prompt, tokens in zip(batch, prompts, samples, strict=True):
                    out[i] = self._text(tokens[len(prompt) :], until)
        for req, text in zip(requests, out, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def _text(self, tokens: list[int], until: tuple[str, ...]) -> str:
        if tokens and tokens[-1] == self._eot:
            tokens = tokens[:-1]
        text = self.tok_decode(tokens)
        for stop in until:
            if stop and stop in text:
                text = text[: text.index(stop)]
        return text


def _generation_options(gen_kwargs: dict[str, Any] | None, default_max: int) -> tuple:
    """``(until, max_gen_toks, temperature)`` of a request's lm-eval generation kwargs
    (temperature 0, greedy, unless ``do_sample``)."""
    kwargs = dict(gen_kwargs or {})
    until = kwargs.pop("until", None) or []
    until = (until,) if isinstance(until, str) else tuple(until)
    max_new = int(kwargs.pop("max_gen_toks", default_max))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    if not kwargs.pop("do_sample", temperature > 0):
        temperature = 0.0
    return until, max_new, temperature
