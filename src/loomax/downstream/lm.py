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
  first stop string.
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
from tokenizers import Tokenizer

from loomax.data.tokenizer import eos_id, load_tokenizer
from loomax.downstream.scoring import Scorer
from loomax.models.config import LmModel
from loomax.models.generate import sample_tokens

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
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            out.append(self._generate(context, dict(gen_kwargs or {})))
            self.cache_hook.add_partial("generate_until", req.args, out[-1])
        return out

    def _generate(self, context: str, kwargs: dict[str, Any]) -> str:
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        if not kwargs.pop("do_sample", temperature > 0):
            temperature = 0.0
        prompt = self.tok_encode(context) or [self.prefix_token_id]
        room = max(1, self.max_length - max_new)
        prompt = prompt[-room:]
        self._key, key = jax.random.split(self._key)
        tokens = sample_tokens(
            self.model,
            prompt,
            seq_len=self.max_length,
            max_new_tokens=max_new,
            temperature=temperature,
            key=key,
            stop_token=self._eot,
        )[len(prompt) :]
        if tokens and tokens[-1] == self._eot:
            tokens = tokens[:-1]
        text = self.tok_decode(tokens)
        for stop in until:
            if stop and stop in text:
                text = text[: text.index(stop)]
        return text
