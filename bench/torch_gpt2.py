"""The PyTorch side of the GPU speed comparison: a nanoGPT-style GPT-2 training step.

Same model and step as ``loomax bench`` on ``config/gpt2_small.yaml`` (GPT-2 124M, tied
embeddings, vocab 50257 unless ``--vocab``), trained the way nanoGPT and llm.c train it on
one GPU: bf16 autocast over fp32 parameters, ``scaled_dot_product_attention`` (flash),
fused AdamW, TF32 matmuls allowed, ``torch.compile`` with ``--compile``. Random token ids.
Each timed step ends with a device synchronize; the median step is reported.

Prints one JSON line last: ``tokens_per_second``, ``step_ms_median``, ``compile_s``, ...
Runs on CPU too (``--device cpu``, fp32, for checking the script itself).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (
            t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():  # GPT-2's init: N(0, 0.02), residual outputs scaled
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                scaled = name.endswith(("proj.weight", "down.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if scaled else 0.02)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()

    cuda = args.device.startswith("cuda")
    torch.manual_seed(0)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = Gpt2(args.vocab, args.seq, args.dim, args.layers, args.heads).to(args.device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda
    )
    forward = torch.compile(model) if args.compile else model
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if cuda
        else torch.autocast("cpu", enabled=False)
    )
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
        for _ in range(4)
    ]

    def step(i: int) -> float:
        data = batches[i % len(batches)]
        with amp:
            loss = forward(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    start = time.perf_counter()
    step(0)
    sync()
    compile_s = time.perf_counter() - start
    for i in range(args.warmup):
        step(i)
    sync()
    times = []
    for i in range(args.steps):
        start = time.perf_counter()
        loss = step(i)
        sync()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    print(
        json.dumps(
            {
                "impl": "torch.compile" if args.compile else "torch eager",
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "compile_s": round(compile_s, 2),
                "step_ms_median": round(step_s * 1e3, 2),
                "step_ms_min": round(min(times) * 1e3, 2),
                "tokens_per_second": round(args.batch * args.seq / step_s, 1),
                "params": sum(q.numel() for q in model.parameters()),
                "final_loss": float(loss),
                "batch": args.batch,
                "seq": args.seq,
                "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                if cuda
                else None,
            }
        )
    )


if __name__ == "__main__":
    main()
