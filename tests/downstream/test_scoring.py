"""``Scorer``: packed log-likelihoods equal one request per row, and a direct computation."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import numpy as np

from loomax.downstream.scoring import Scorer, has_absolute_positions


@eqx.filter_jit
def _logits(model, ids):
    return model.logits(hax.named(ids, "position")).array


def logits_of(model, row) -> np.ndarray:
    """The model's logits of one row, computed as one program over the row followed by zeros
    up to ``seq_len`` (the models are causal: what follows a position never reaches it), so
    one compile a model serves every length (op by op, each length compiled its own ops)."""
    padded = np.zeros(model.config.seq_len, np.int32)
    padded[: len(row)] = row
    return np.asarray(_logits(model, padded))[: len(row)]


def direct(model, context, continuation):
    """Sum of log p(continuation) and greedy-ness from the model's logits, one request alone."""
    whole = np.asarray(context + continuation, np.int32)
    logits = logits_of(model, whole[:-1]).astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    n = len(continuation)
    rows = np.arange(len(whole) - 1 - n, len(whole) - 1)
    targets = whole[1:][-n:]
    return float(logp[rows, targets].sum()), bool((logits[rows].argmax(-1) == targets).all())


def requests(vocab, count=13, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ctx = rng.integers(0, vocab, rng.integers(1, 20)).tolist()
        cont = rng.integers(0, vocab, rng.integers(1, 8)).tolist()
        out.append((ctx, cont))
    out.append(([1, 2, 3], [int(rng.integers(0, vocab))]))
    return out


def test_packing_gives_the_same_loglikelihoods_as_one_request_per_row(llama):
    reqs = requests(llama.Vocab.size)
    packed = Scorer(llama, batch_size=3, pack=True)
    assert len(packed._pack([packed._piece(i, *r) for i, r in enumerate(reqs)])) < len(reqs)
    got = packed.score(reqs)
    want = Scorer(llama, batch_size=4, pack=False).score(reqs)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5, atol=1e-5)
    assert [g[1] for g in got] == [w[1] for w in want]
    for (ctx, cont), (logp, greedy) in zip(reqs, got, strict=True):
        want_logp, want_greedy = direct(llama, ctx, cont)
        assert abs(logp - want_logp) < 1e-4
        assert greedy == want_greedy


def test_greedy_continuations_are_reported(llama):
    ctx = [5, 6, 7]
    logits = logits_of(llama, ctx)
    best = int(logits[-1].argmax())
    worst = int(logits[-1].argmin())
    (_, greedy), (_, not_greedy) = Scorer(llama).score([(ctx, [best]), (ctx, [worst])])
    assert greedy and not not_greedy


def test_long_requests_keep_the_last_tokens(llama):
    seq_len = llama.config.seq_len
    ctx, cont = list(range(1, 50)), [7, 8]
    ((logp, _),) = Scorer(llama).score([(ctx, cont)])
    want, _ = direct(llama, (ctx + cont)[-(seq_len + 1) : -len(cont)], cont)
    assert abs(logp - want) < 1e-4


def test_absolute_positions_are_not_packed(gpt2, llama):
    assert has_absolute_positions(gpt2) and not has_absolute_positions(llama)
    scorer = Scorer(gpt2, batch_size=2)
    assert not scorer.pack
    reqs = requests(gpt2.Vocab.size, count=5, seed=1)
    for (ctx, cont), (logp, _) in zip(reqs, scorer.score(reqs), strict=True):
        assert abs(logp - direct(gpt2, ctx, cont)[0]) < 1e-4


def test_one_compile_for_all_batches(llama):
    from loomax.downstream import scoring

    before = scoring._score_batch._cache_size()
    Scorer(llama, batch_size=2, pack=True).score(requests(llama.Vocab.size, count=20, seed=3))
    assert scoring._score_batch._cache_size() - before <= 1
    jax.clear_caches()
