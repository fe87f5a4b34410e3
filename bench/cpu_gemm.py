"""The LM head's three matmuls on the CPU: XLA against torch and OpenBLAS (numpy), alternating.

    .venv/bin/python bench/cpu_gemm.py [--rounds 3] [--tokens 2048] [--block 512]

The bench GPT-2 (config/bench/gpt2_tiny.yaml) spends most of its step in the tied LM head:
per block of ``--block`` tokens the logits ``h @ w.T``, then ``dlogits @ w`` and
``dlogits.T @ h`` (embed 256, vocabulary 50257). torch.compile's step does the same three
matmuls. This prints each library's GFLOP/s per matmul (best of 3 per round, median over
rounds, fresh inputs, f32) and how long the head's matmuls alone take for ``--tokens``
tokens at those rates: a lower bound on the step for each library, since the softmax, the
blocks and the optimizer come on top (an estimate from measured matmul rates, not a
measurement of the step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

EMBED, VOCAB = 256, 50257


def shapes(block: int) -> dict[str, tuple[tuple[int, int], tuple[int, int], bool]]:
    """name: (lhs shape, rhs shape, rhs transposed) of the head's matmuls for one block."""
    return {
        "logits h @ w.T": ((block, EMBED), (VOCAB, EMBED), True),
        "dh dlogits @ w": ((block, VOCAB), (VOCAB, EMBED), False),
        "dw dlogits.T @ h": ((VOCAB, block), (block, EMBED), False),
    }


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def rates(lhs_shape, rhs_shape, transposed: bool) -> dict[str, float]:
    """GFLOP/s of one matmul per library, measured back to back on the same inputs."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(lhs_shape, dtype=np.float32)
    b = rng.standard_normal(rhs_shape, dtype=np.float32)
    m, k = lhs_shape
    n = rhs_shape[0] if transposed else rhs_shape[1]
    flops = 2 * m * k * n
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    xla = jax.jit(lambda x, y: x @ y.T) if transposed else jax.jit(lambda x, y: x @ y)
    xla(ja, jb).block_until_ready()
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    runs = {
        "xla": lambda: xla(ja, jb).block_until_ready(),
        "torch": (lambda: ta @ tb.T) if transposed else (lambda: ta @ tb),
        "openblas": (lambda: a @ b.T) if transposed else (lambda: a @ b),
    }
    return {name: flops / timed(fn) / 1e9 for name, fn in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (8 x 256)")
    parser.add_argument("--block", type=int, default=512, help="model.cross_entropy_block_size")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    per: dict[str, dict[str, list[float]]] = {}
    for rnd in range(args.rounds):
        items = list(shapes(args.block).items())
        for name, shape in items if rnd % 2 == 0 else items[::-1]:
            for lib, rate in rates(*shape).items():
                per.setdefault(name, {}).setdefault(lib, []).append(rate)
        print(f"round {rnd + 1} load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    libs = ("xla", "torch", "openblas")
    flops = 3 * 2 * args.tokens * EMBED * VOCAB
    print(f"\n{'matmul (block ' + str(args.block) + ')':<24}" + "".join(f"{x:>10}" for x in libs))
    medians = {n: {lib: statistics.median(v) for lib, v in r.items()} for n, r in per.items()}
    for name, row in medians.items():
        print(f"{name:<24}" + "".join(f"{row[lib]:>10.0f}" for lib in libs) + "  GFLOP/s")
    head = {lib: sum(flops / 3 / (medians[n][lib] * 1e9) for n in medians) for lib in libs}
    print(
        f"{'head matmuls, ' + str(args.tokens) + ' tok':<24}"
        + "".join(f"{head[lib] * 1e3:>10.0f}" for lib in libs)
        + "  ms (estimate: the matmuls alone)"
    )
    print(json.dumps({"gflops": medians, "head_ms": {k: v * 1e3 for k, v in head.items()}}))


if __name__ == "__main__":
    main()
