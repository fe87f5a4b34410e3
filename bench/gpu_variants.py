"""bench/gpu.py's ``loomax bench`` variants (GPT-2 124M, the Llama-1B shape) and the
``torch-gpt2`` section."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from gpu_checks import GPT2_BATCH, LLAMA_BATCH, REPO


def _bench(args, config_path: str, overrides: list[str], profile: bool) -> dict:
    """``loomax bench`` of a shipped config with ``overrides``, traced when ``profile``."""
    from loomax.benchmark import run_benchmark
    from loomax.config import parse_config
    from loomax.hooks.profiler import summarize_trace
    from loomax.lm import TrainLmConfig

    config = parse_config(TrainLmConfig, REPO / config_path, overrides)
    profile_dir = tempfile.mkdtemp(prefix="loomax-profile-") if profile else None
    result = run_benchmark(config, steps=args.steps, warmup=args.warmup, profile_dir=profile_dir)
    result["config"] = f"{config_path} {' '.join(overrides)}"
    if result.get("profile_dir"):
        try:
            result["profile"] = summarize_trace(profile_dir, top=24)
        except Exception as e:  # noqa: BLE001 - the timings stand without it
            result["profile_error"] = f"{type(e).__name__}: {e}"
    return result


def flags(settings: dict[str, object]) -> list[str]:
    """``{"model.seq_len": 128}`` as command-line overrides."""
    return [x for key, value in settings.items() for x in (f"--{key}", str(value))]


SMOKE_GPT2 = {
    "model.hidden_dim": 64,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.seq_len": 128,
}
SMOKE_LLAMA = {
    **SMOKE_GPT2,
    "model.intermediate_dim": 128,
    "model.num_kv_heads": 2,
    "model.head_dim": 16,
    "model.seq_len": 256,
}


def bench_overrides(args, vocab: int, batch: int, smoke: dict, extra: tuple[str, ...]) -> list[str]:
    """The bench settings every variant shares (bf16 compute, no timed checkpoints), toy-sized
    with ``--smoke``, then the variant's own ``extra``."""
    settings = {
        "model.vocab_size": 1000 if args.smoke else vocab,
        "trainer.train_batch_size": 2 if args.smoke else batch,
        "trainer.mp": "p=f32,c=bfloat16",
        "trainer.checkpointer.save_interval": "null",
        **(smoke if args.smoke else {}),
    }
    return flags(settings) + list(extra)


def gpt2_overrides(args, *extra: str) -> list[str]:
    return bench_overrides(args, 50257, GPT2_BATCH, SMOKE_GPT2, extra)


def llama_overrides(args, *extra: str) -> list[str]:
    return bench_overrides(args, 128256, LLAMA_BATCH, SMOKE_LLAMA, extra)


NO_TRITON_GEMM = "--xla_gpu_enable_triton_gemm=false"
REMAT = ["--model.gradient_checkpointing", "true"]
PAD128 = ["--model.cross_entropy_vocab_multiple", "128"]
UNSCANNED = ["--model.gradient_checkpointing", "false", "--model.scan_layers", "false"]
GPT2_VARIANTS = {  # name: (overrides beyond gpt2_overrides, extra XLA flags, profile?)
    "gpt2-ntg-remat-pad128": ([*REMAT, *PAD128], NO_TRITON_GEMM, True),
    "gpt2-ntg-save-attn": (
        [*REMAT, *PAD128, "--model.remat_save", "[qkv,attn_out]"],
        NO_TRITON_GEMM,
        False,
    ),
    "gpt2-ntg-save-dots": (
        [*REMAT, *PAD128, "--model.remat_save", "[qkv,attn_out,mlp_up]"],
        NO_TRITON_GEMM,
        False,
    ),
    "gpt2-ntg-unscanned": ([*UNSCANNED, *PAD128], NO_TRITON_GEMM, True),
    "gpt2-ntg-unscanned-remat": (
        [*REMAT, "--model.scan_layers", "false", *PAD128],
        NO_TRITON_GEMM,
        False,
    ),
    "gpt2-unscanned": (UNSCANNED, "", False),
    "gpt2-ntg-unscanned-ce16k": (
        [*UNSCANNED, "--model.cross_entropy_block_size", "16384"],
        NO_TRITON_GEMM,
        False,
    ),
    # XLA's cuDNN layer-norm rewrite (norm fusions are part of what is left in the profile)
    "gpt2-ntg-unscanned-cudnn-ln": (
        UNSCANNED,
        f"{NO_TRITON_GEMM} --xla_gpu_enable_cudnn_layer_norm=true",
        False,
    ),
    "gpt2-ntg-unscanned-b64": (
        [*UNSCANNED, *PAD128, "--trainer.train_batch_size", "64"],
        NO_TRITON_GEMM,
        False,
    ),
    "gpt2-ntg-b64-pad128": (
        [*REMAT, *PAD128, "--trainer.train_batch_size", "64"],
        NO_TRITON_GEMM,
        False,
    ),
    "gpt2-ntg-remat": (REMAT, NO_TRITON_GEMM, True),
    "gpt2-ntg-remat-unroll": (
        [*REMAT, "--model.scan_unroll", "true"],
        NO_TRITON_GEMM,
        True,
    ),
    "gpt2-ntg-unroll": (
        ["--model.gradient_checkpointing", "false", "--model.scan_unroll", "true"],
        NO_TRITON_GEMM,
        False,
    ),
    "gpt2-ntg-remat-v50304": (
        [*REMAT, "--model.vocab_size", "50304"],
        NO_TRITON_GEMM,
        False,
    ),
    "gpt2-ntg-remat-ce16k": (
        [*REMAT, "--model.cross_entropy_block_size", "16384"],
        NO_TRITON_GEMM,
        False,
    ),
    "gpt2": (["--model.gradient_checkpointing", "false"], "", True),
    "gpt2-remat": (REMAT, "", False),
    "gpt2-xla-attn": (
        ["--model.gradient_checkpointing", "false", "--model.attn_backend", "xla"],
        "",
        False,
    ),
    "gpt2-no-triton-gemm": (
        ["--model.gradient_checkpointing", "false"],
        "--xla_gpu_enable_triton_gemm=false",
        False,
    ),
    "gpt2-ce-unblocked": (
        ["--model.gradient_checkpointing", "false", "--model.cross_entropy_block_size", "null"],
        "",
        False,
    ),
}
LLAMA_VARIANTS = {
    "llama1b-packed": (
        ["--model.gradient_checkpointing", "false", "--model.cudnn_packed_documents", "16"],
        "",
        True,
    ),
    "llama1b-unscanned": (UNSCANNED, "", True),
    # FP8 linear layers (e4m3/e5m2, current scaling) beside the bf16 row above: the fp8 goal
    "llama1b-unscanned-fp8": (
        [*UNSCANNED, "--model.fp8", "emulate" if "--smoke" in sys.argv else "on"],
        "",
        True,
    ),
    "llama1b-ntg-unscanned": (UNSCANNED, NO_TRITON_GEMM, False),
    "llama1b-unscanned-packed": (
        [*UNSCANNED, "--model.cudnn_packed_documents", "16"],
        "",
        False,
    ),
    "llama1b-ntg": (["--model.gradient_checkpointing", "false"], NO_TRITON_GEMM, True),
    "llama1b-ntg-unroll": (
        ["--model.gradient_checkpointing", "false", "--model.scan_unroll", "true"],
        NO_TRITON_GEMM,
        False,
    ),
    "llama1b": (["--model.gradient_checkpointing", "false"], "", True),
    "llama1b-remat": (REMAT, "", False),
    "llama1b-no-docmask": (
        ["--model.gradient_checkpointing", "false", "--model.document_mask", "false"],
        "",
        False,
    ),
}


def section_bench(args) -> dict:
    name = args.child
    if name in GPT2_VARIANTS:
        extra, _, profile = GPT2_VARIANTS[name]
        return _bench(args, "config/gpt2_small.yaml", gpt2_overrides(args, *extra), profile)
    extra, _, profile = LLAMA_VARIANTS[name]
    return _bench(args, "config/llama_1b.yaml", llama_overrides(args, *extra), profile)


def section_torch(args, batch: int = GPT2_BATCH) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    cmd = [
        sys.executable,
        str(REPO / "bench" / "torch_gpt2.py"),
        "--compile",
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    cmd += (
        ["--batch", str(batch)]
        if not args.smoke
        else ["--batch", "4", "--dim", "64", "--layers", "2", "--heads", "4", "--seq", "128"]
    )
    if not cuda:
        cmd += ["--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(done.stderr[-4000:])
    if done.returncode:
        raise RuntimeError(f"torch_gpt2.py exited {done.returncode}: {done.stderr[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
