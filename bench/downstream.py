"""Requests/s of Loomax's lm-eval backend, packed vs one request per row, and lm-eval's own
``hf`` backend (transformers, PyTorch) on the same model exported by ``loomax.hf``.

A random-weight Llama (hidden 256, 4 layers, seq 256) and a byte-level BPE of 2,000 tokens
trained here; multiple-choice-shaped requests (a ~30-token context and a few-token
continuation, as HellaSwag/ARC give), all scored through ``LM.loglikelihood``. Each
backend is warmed up on the first batch (the compile), then timed twice over all requests,
alternating backends; the median is reported. Then ``generate_until`` (greedy, up to 16 new
tokens, no stop string): rows decoded ``--batch`` at a time vs one request at a time,
through the same Loomax code. CPU, f32. Prints two tables and a JSON line.

    .venv/bin/python bench/downstream.py [--requests 512] [--batch 16] [--generate 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from loomax.data.tokenizer import train_bpe_tokenizer
from loomax.downstream import lm_eval_model
from loomax.hf import export_hf
from loomax.hf.convert import special_token_ids
from loomax.models import LlamaConfig

WORDS = (
    "the a cat dog sat on mat log sky capital of France Italy one two plus is hot cold wet".split()
)


class Request:
    """What lm-eval hands an ``LM``: an object with ``args``."""

    def __init__(self, *args):
        self.args = args


def make_requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        context = " ".join(rng.choice(WORDS, rng.integers(20, 40)))
        continuation = " " + " ".join(rng.choice(WORDS, rng.integers(1, 5)))
        out.append(Request(context, continuation))
    return out


def timed(fn, requests, rounds: int) -> float:
    fn(requests[:8])  # compile / warm up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(requests)
        times.append(time.perf_counter() - start)
    return len(requests) / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--generate", type=int, default=64, help="generate_until requests")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="loomax-bench-downstream-"))
    corpus = [" ".join(np.random.default_rng(i).choice(WORDS, 60)) for i in range(400)]
    tokenizer = work / "tokenizer.json"
    train_bpe_tokenizer(corpus, 2000, tokenizer)
    from loomax.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    config = LlamaConfig(
        seq_len=256,
        hidden_dim=256,
        intermediate_dim=1024,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
    )
    model = config.build(tok.get_vocab_size(), key=jax.random.PRNGKey(0))
    requests = make_requests(args.requests)

    packed = lm_eval_model(model, tokenizer, batch_size=args.batch, pack=True)
    unpacked = lm_eval_model(model, tokenizer, batch_size=args.batch, pack=False)
    export_hf(model, work / "hf", tokenizer=tokenizer, special_tokens=special_token_ids(tok))
    import torch
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(work / "hf"), device="cpu", dtype=torch.float32, batch_size=args.batch)
    results = {}
    for name, lm in (
        ("loomax packed", packed),
        ("loomax one per row", unpacked),
        ("lm-eval hf", hf),
    ):
        results[name] = timed(
            lambda r, lm=lm: lm.loglikelihood(r, disable_tqdm=True), requests, args.rounds
        )
    # the same scores from all three (a check, not a timing)
    a = [x for x, _ in packed.loglikelihood(requests[:32], disable_tqdm=True)]
    b = [x for x, _ in hf.loglikelihood(requests[:32], disable_tqdm=True)]
    max_diff = float(np.max(np.abs(np.array(a) - np.array(b))))

    base = results["loomax one per row"]
    print(f"{args.requests} requests, batch {args.batch}, {jax.devices()[0].platform}, f32")
    print(f"{'backend':22} {'requests/s':>11} {'vs one per row':>15}")
    for name, rate in results.items():
        print(f"{name:22} {rate:11.1f} {rate / base:14.2f}x")
    print(
        f"max |loglikelihood difference| loomax packed vs lm-eval hf (32 requests): {max_diff:.2e}"
    )
    generation = time_generation(model, tokenizer, args)
    print(f"{'generate_until':22} {'requests/s':>11} {'vs one at a time':>17}")
    for name, rate in generation.items():
        print(f"{name:22} {rate:11.2f} {rate / generation['one at a time']:16.2f}x")
    print(
        json.dumps(
            {
                "requests_per_s": results,
                "generate_requests_per_s": generation,
                "max_abs_diff": max_diff,
                "batch": args.batch,
            }
        )
    )


def time_generation(model, tokenizer, args) -> dict[str, float]:
    """generate_until requests/s, ``args.batch`` rows at a time vs one request at a time."""
    prompts = [r.args[0] for r in make_requests(args.generate, seed=1)]
    requests = [Request(p, {"until": [], "max_gen_toks": 16}) for p in prompts]
    batched = lm_eval_model(model, tokenizer, batch_size=args.batch)
    single = lm_eval_model(model, tokenizer, batch_size=1)
    rates = {}
    for name, lm in (("batched", batched), ("one at a time", single)):
        rates[name] = timed(lambda r, lm=lm: lm.generate_until(r), requests, args.rounds)
    assert batched.generate_until(requests[:4]) == single.generate_until(requests[:4])
    return rates


if __name__ == "__main__":
    main()
