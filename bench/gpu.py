"""The GPU checks and benchmarks of Loomax's default GPU path, in one unattended run.

``bench/gpu.sh`` runs this on a CUDA host (offline: Loomax's extra packages come from a
wheel folder). Each section runs in its own process with its own time limit, in order of
importance, until the budget is spent; a section that fails or times out is recorded and
the run goes on. One table is printed last, and everything goes to ``gpu_results.json``
(in ``$OUT`` when set, else ``bench/results/``) after every section.

Sections:
- ``env``: JAX, CUDA/cuDNN, the GPU.
- ``attention``: cuDNN attention against the xla and blockwise backends and a float32
  reference (values and gradients; causal and document masks; MHA and GQA; bf16), the
  cases where ``auto`` must fall back, and that a jitted model really calls cuDNN.
- ``gpt2-*``, ``llama1b-*``: ``loomax bench`` on GPT-2 124M (seq 1024) and the Llama-1B
  shape (seq 4096), bf16 compute, tokens/s and MFU; variants differ by one setting.
- ``torch-gpt2``: the nanoGPT-style PyTorch GPT-2 under ``torch.compile`` (bench/torch_gpt2.py).
- ``train``: the quickstart for 100 steps in f32 and in bf16 (device memory metrics in
  metrics.jsonl); its data is built in memory, in this process (no Ray on the host).
- ``resume``: a checkpoint written on the GPU resumes bitwise on the GPU (20 steps
  straight against 10 + 10 resumed, deterministic XLA reductions).

``--smoke`` runs every section at toy sizes (works on CPU: checks this script).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPT2_BATCH = 32
LLAMA_BATCH = 8


# --------------------------------------------------------------------------- sections
def section_env(args) -> dict:
    import jax

    device = jax.devices()[0]
    out = {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "compute_capability": getattr(device, "compute_capability", None),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        out["device_memory_gb"] = round(stats["bytes_limit"] / 2**30, 1)
    try:
        from jax._src.lib import cuda_versions

        out["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception as e:  # noqa: BLE001 - informational only
        out["cudnn"] = f"unknown ({e})"
    for package in ("haliax", "equinox", "optax", "draccus", "jmp", "tensorstore", "torch"):
        try:
            from importlib.metadata import version

            out[package] = version(package)
        except Exception:  # noqa: BLE001
            out[package] = None
    try:
        out["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out["nvidia_smi"] = None
    return out


def save_partial(args, result: dict) -> None:
    """Write what a section has so far: a section stopped at its time limit keeps it."""
    Path(args.result).write_text(json.dumps(result, default=str))


def _rel_err(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def section_attention(args) -> dict:
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import numpy as np

    from loomax.models.attention import (
        causal_attention,
        cudnn_unsupported_reason,
        gpu_compute_capability,
        resolve_backend,
    )

    on_gpu = gpu_compute_capability() is not None
    B, T, H, KV, D = (2, 128, 4, 2, 32) if args.smoke else (2, 512, 8, 2, 64)
    half = jnp.bfloat16
    tolerance = 2e-2  # bf16 operands: a relative error of 1e-3..1e-2 is expected

    def inputs(kv_heads: int, head_size: int, seq: int, seed: int):
        k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
        q = jax.random.normal(k1, (B, seq, H, head_size), jnp.float32)
        k = jax.random.normal(k2, (B, seq, kv_heads, head_size), jnp.float32)
        v = jax.random.normal(k3, (B, seq, kv_heads, head_size), jnp.float32)
        cot = jax.random.normal(k4, (B, seq, H, head_size), jnp.float32)
        return q, k, v, cot

    def segments(seq: int, seed: int):
        rng = np.random.default_rng(seed)  # 3 documents a row, of random lengths
        rows = []
        for _ in range(B):
            cuts = np.sort(rng.choice(np.arange(8, seq - 8), 2, replace=False))
            rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
        return hax.named(jnp.asarray(np.stack(rows), jnp.int32), ("batch", "position"))

    def run(backend, q, k, v, cot, seg, dtype):
        kv_axis = "kv_heads" if k.shape[2] != q.shape[2] else "heads"
        # cudnn-packed: cuDNN's packed-sequence kernel (rows have 3 documents, limit 8);
        # cudnn-packed-over: a limit of 2, so the batch takes the dense-mask branch
        documents = {"cudnn-packed": 8, "cudnn-packed-over": 2}.get(backend, 0)

        def f(qa, ka, va):
            out = causal_attention(
                hax.named(qa, ("batch", "position", "heads", "head_size")),
                hax.named(ka, ("batch", "key_position", kv_axis, "head_size")),
                hax.named(va, ("batch", "key_position", kv_axis, "head_size")),
                backend="cudnn" if documents else backend,
                segment_ids=seg,
                cudnn_documents=documents,
            ).array
            return jnp.sum(out.astype(jnp.float32) * cot), out

        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
        (_, out), grads = grad(q.astype(dtype), k.astype(dtype), v.astype(dtype))
        return [np.asarray(x.astype(jnp.float32)) for x in (out, *grads)], grad

    cases, ok, t0 = [], True, time.perf_counter()
    backends = ["cudnn", "xla", "blockwise"] if on_gpu else ["xla", "blockwise"]
    for masked in (False, True) if args.attention_cases == "all" else (True,):
        for kv_heads in (H, KV):
            name = f"{'documents' if masked else 'causal'}/{'mha' if kv_heads == H else 'gqa'}"
            q, k, v, cot = inputs(kv_heads, D, T, seed=len(cases))
            seg = segments(T, len(cases)) if masked else None
            want, _ = run("vanilla", q, k, v, cot, seg, jnp.float32)
            row = {"case": name, "shape": f"B{B} T{T} H{H} KV{kv_heads} D{D} bf16"}
            results = {}
            extra = ["cudnn-packed", "cudnn-packed-over"] if on_gpu and masked else []
            for backend in backends + extra:
                print(f"attention {name} {backend} ({time.perf_counter() - t0:.1f} s)", flush=True)
                got, _ = run(backend, q, k, v, cot, seg, half)
                results[backend] = got
                errs = [_rel_err(g, w) for g, w in zip(got, want, strict=True)]
                row[backend] = {
                    n: round(e, 5) for n, e in zip(("out", "dq", "dk", "dv"), errs, strict=True)
                }
                ok &= max(errs) < tolerance
            for other in ("cudnn", *extra):
                if other in results:
                    errs = [
                        _rel_err(a, b) for a, b in zip(results[other], results["xla"], strict=True)
                    ]
                    row[f"{other}_vs_xla"] = round(max(errs), 5)
                    ok &= max(errs) < tolerance
            cases.append(row)
            save_partial(args, {"ok": bool(ok), "tolerance": tolerance, "cases": cases})

    # auto: which cases cuDNN cannot serve, and that auto then still runs (on another backend)
    capability = gpu_compute_capability()
    fallbacks = []
    fallback_cases = (
        ()
        if args.attention_cases != "all"
        else (
            ("float32", jnp.float32, D, T, False),
            ("head size 12", half, 12, T, False),
            ("head size 320", half, 320, 256, False),
            ("documents, odd seq", half, D, T - 1, True),
            ("supported (bf16, causal)", half, D, T, False),
        )
    )
    for label, dtype, head_size, seq, masked in fallback_cases:
        print(f"attention fallback {label} ({time.perf_counter() - t0:.1f} s)", flush=True)
        q, k, v, cot = inputs(H, head_size, seq, seed=99)
        seg = segments(seq, 99) if masked else None
        reason = cudnn_unsupported_reason(
            dtype, head_size, seq, segments=masked, compute_capability=capability
        )
        entry = {
            "case": label,
            "auto": resolve_backend("auto", dtype, seq, head_size, segments=masked),
            "reason": reason,
        }
        try:
            got, _ = run("auto", q, k, v, cot, seg, dtype)
            want, _ = run("vanilla", q, k, v, cot, seg, jnp.float32)
            entry["auto_err"] = round(
                max(_rel_err(g, w) for g, w in zip(got, want, strict=True)), 5
            )
            ok &= entry["auto_err"] < tolerance
        except Exception as e:  # noqa: BLE001 - recorded: auto must never fail
            entry["auto_error"] = f"{type(e).__name__}: {e}"[:300]
            ok = False
        if on_gpu and reason is not None:  # does cuDNN itself refuse it? (our rule vs the kernel)
            try:
                import jax.nn

                mask = None
                if seg is not None:
                    s = seg.array
                    mask = (s[:, :, None] == s[:, None, :])[:, None]

                def direct(a, b, c, mask):
                    out = jax.nn.dot_product_attention(
                        a, b, c, mask=mask, is_causal=True, implementation="cudnn"
                    )
                    return jnp.sum(out.astype(jnp.float32))

                f = jax.jit(jax.grad(direct))
                f(q.astype(dtype), k.astype(dtype), v.astype(dtype), mask).block_until_ready()
                entry["cudnn_direct"] = "accepted (our rule is stricter than cuDNN)"
            except Exception as e:  # noqa: BLE001
                entry["cudnn_direct"] = (
                    f"refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                )
        fallbacks.append(entry)
        save_partial(
            args, {"ok": bool(ok), "tolerance": tolerance, "cases": cases, "fallbacks": fallbacks}
        )

    # a jitted GPT-2 with attn_backend auto in bf16 calls the cuDNN kernel
    uses_cudnn = None
    try:
        import equinox as eqx

        from loomax.models import Gpt2Config

        config = Gpt2Config(seq_len=256, hidden_dim=256, num_layers=2, num_heads=4)
        model = config.build(1000, key=jax.random.PRNGKey(0))
        model = jax.tree.map(
            lambda x: x.astype(half) if jnp.issubdtype(x.dtype, jnp.floating) else x, model
        )
        ids = hax.named(jnp.zeros((2, 256), jnp.int32), ("batch", "position"))
        params, static = eqx.partition(model, eqx.is_array)
        logits = jax.jit(lambda p: eqx.combine(p, static).logits(ids).array)
        hlo = logits.lower(params).compile().as_text()
        uses_cudnn = "cudnn" in hlo.lower()
        if on_gpu:
            ok &= uses_cudnn
    except Exception as e:  # noqa: BLE001 - recorded
        uses_cudnn = f"check failed: {type(e).__name__}: {e}"[:300]
        ok = False
    return {
        "ok": bool(ok),
        "tolerance": tolerance,
        "cases": cases,
        "fallbacks": fallbacks,
        "model_auto_calls_cudnn": uses_cudnn,
        "shape": f"B{B} T{T} H{H} KV{KV} D{D}",
    }


def _bench(args, config_path: str, overrides: list[str], profile: bool) -> dict:
    """``loomax bench`` of a shipped config with ``overrides``, traced when ``profile``."""
    from loomax.benchmark import run_benchmark
    from loomax.callbacks.profiler import summarize_trace
    from loomax.config import parse_config
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


def _metrics(run_dir: Path) -> list[dict]:
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def _series(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r and "step" in r}


def _quickstart_runner(args):
    """``train(run, *overrides)``: the quickstart (data in memory, no Ray) into ``work/run``."""
    from loomax.config import parse_config
    from loomax.lm import TrainLmConfig
    from loomax.train_lm import train_lm

    work = Path(tempfile.mkdtemp(prefix="loomax-gpu-train-"))
    overlay = work / "memory.yaml"
    overlay.write_text("trainer:\n  hooks:\n    - type: memory\n      every: 10\n")
    base = [
        "--data.cache_dir",
        "memory://quickstart",
        "--trainer.progress_bar",
        "false",
        "--trainer.checkpointer.save_interval",
        "null",
    ]
    if args.smoke:
        base += ["--data.train", '[{"embedded": "python_stdlib", "max_documents": 100}]']

    def train(run: str, *extra: str):
        config = parse_config(
            TrainLmConfig,
            REPO / "config/quickstart.yaml",
            [*base, "--overlay", str(overlay), "--trainer.run_dir", str(work / run), *extra],
        )
        start = time.perf_counter()
        result = train_lm(config)
        return result, time.perf_counter() - start

    return train, work


def section_train(args) -> dict:
    import jax

    train, work = _quickstart_runner(args)
    steps = 20 if args.smoke else 100
    out: dict = {"steps": steps}
    runs = {}
    for label, mp in (("f32", "f32"), ("bf16", "p=f32,c=bfloat16")):
        result, seconds = train(
            label,
            "--trainer.mp",
            mp,
            "--trainer.num_train_steps",
            str(steps),
            "--trainer.steps_per_eval",
            str(steps),
        )
        records = _metrics(work / label)
        runs[label] = records
        out[label] = {
            "seconds": round(seconds, 1),
            "eval_loss": result.evals[-1][1]["eval/loss"] if result.evals else None,
            "train_loss": _series(records, "train/loss"),
            "tokens_per_second": list(_series(records, "throughput/tokens_per_second").values())[
                -1:
            ],
        }
    f32, bf16 = out["f32"]["train_loss"], out["bf16"]["train_loss"]
    common = sorted(set(f32) & set(bf16))
    out["max_abs_train_loss_diff"] = round(max(abs(f32[s] - bf16[s]) for s in common), 4)
    out["eval_loss_rel_diff"] = round(
        abs(out["bf16"]["eval_loss"] / out["f32"]["eval_loss"] - 1), 4
    )
    memory_keys = sorted({k for r in runs["bf16"] for k in r if k.startswith("memory/")})
    out["memory_keys"] = memory_keys
    peak = [r["memory/device_peak_bytes"] for r in runs["bf16"] if "memory/device_peak_bytes" in r]
    out["device_peak_mb"] = round(peak[-1] / 2**20, 1) if peak else None
    on_gpu = jax.default_backend() == "gpu"
    out["tracks"] = out["max_abs_train_loss_diff"] < 0.1 and out["eval_loss_rel_diff"] < 0.02
    out["memory_ok"] = (not on_gpu) or {
        "memory/device_bytes_in_use",
        "memory/device_peak_bytes",
    } <= set(memory_keys)

    out["ok"] = bool(out["tracks"] and out["memory_ok"])
    for label in ("f32", "bf16"):  # keep the JSON short: every 10th loss
        out[label]["train_loss"] = {s: round(v, 4) for s, v in out[label]["train_loss"].items()}
    return out


def section_resume(args) -> dict:
    """A checkpoint written here resumes bitwise: 2k steps straight vs k, stop, resume to 2k."""
    import jax
    import numpy as np

    train, work = _quickstart_runner(args)
    half = 10 if args.smoke else 20
    # a constant learning rate: the schedule must not depend on num_train_steps, which is how
    # the first attempt is made to stop half way
    common_args = [
        "--trainer.mp",
        "p=f32,c=bfloat16",
        "--trainer.log_every",
        "1",
        "--optimizer.lr_schedule",
        "constant",
        "--optimizer.warmup",
        "0",
        "--trainer.steps_per_eval",
        "1000",
        "--trainer.eval_at_start",
        "false",
        "--sample.enabled",
        "false",
    ]
    straight, _ = train("straight", *common_args, "--trainer.num_train_steps", str(2 * half))
    train("resumed", *common_args, "--trainer.num_train_steps", str(half))
    resumed, _ = train("resumed", *common_args, "--trainer.num_train_steps", str(2 * half))
    a = _series(_metrics(work / "straight"), "train/loss")
    b = _series(_metrics(work / "resumed"), "train/loss")
    after = [s for s in sorted(a) if s > half]
    leaves_a = jax.tree.leaves(straight.final.state)
    leaves_b = jax.tree.leaves(resumed.final.state)
    same_state = len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(leaves_a, leaves_b, strict=True)
        if hasattr(x, "shape")
    )
    out = {
        "steps": f"{2 * half} straight vs {half} + resume to {2 * half}",
        "loss_steps_compared": len(after),
        "losses_bitwise_equal": all(a[s] == b.get(s) for s in after) and bool(after),
        "final_state_bitwise_equal": bool(same_state),
        "first_difference": next(
            ({"step": s, "straight": a[s], "resumed": b.get(s)} for s in after if a[s] != b.get(s)),
            None,
        ),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    out["ok"] = bool(out["losses_bitwise_equal"] and same_state)
    return out


CHILDREN = {
    "env": section_env,
    "attention": section_attention,
    "torch-gpt2": section_torch,
    "torch-gpt2-b64": lambda args: section_torch(args, batch=64),
    "train": section_train,
    "resume": section_resume,
}


def child_function(name: str):
    if name in GPT2_VARIANTS or name in LLAMA_VARIANTS:
        return section_bench
    return CHILDREN[name]


def section_flags(name: str) -> str:
    if name in GPT2_VARIANTS:
        return GPT2_VARIANTS[name][1]
    if name in LLAMA_VARIANTS:
        return LLAMA_VARIANTS[name][1]
    if name == "resume":  # bitwise resume needs reproducible reductions
        return "--xla_gpu_deterministic_ops=true"
    if name == "attention":  # ~40 small programs: autotuning took most of its 150 s on an H200
        return "--xla_gpu_autotune_level=0"
    return ""


# (name, time limit in seconds) in order of importance; the budget cuts the tail
PLAN = [  # the measured best of each model first, then what the next GPU session should try
    ("env", 60),
    ("attention", 150),
    ("gpt2-ntg-unscanned", 120),
    ("torch-gpt2", 200),
    ("llama1b-unscanned", 200),
    ("llama1b-unscanned-packed", 200),
    ("train", 200),
    ("resume", 150),
    ("gpt2-unscanned", 120),
    ("gpt2-ntg-unscanned-ce16k", 120),
    ("gpt2-ntg-unscanned-cudnn-ln", 120),
    ("gpt2-ntg-unscanned-b64", 120),
    ("torch-gpt2-b64", 200),
    ("llama1b-ntg-unscanned", 200),
    ("gpt2-ntg-unscanned-remat", 120),
    ("gpt2-ntg-remat", 150),
    ("gpt2-ntg-remat-pad128", 120),
    ("gpt2-ntg-save-attn", 120),
    ("gpt2-ntg-save-dots", 120),
    ("llama1b", 240),
    ("llama1b-packed", 200),
    ("gpt2-ntg-b64-pad128", 150),
    ("gpt2", 180),
    ("gpt2-remat", 150),
    ("gpt2-xla-attn", 150),
    ("gpt2-no-triton-gemm", 150),
    ("llama1b-no-docmask", 200),
    ("llama1b-remat", 200),
    ("gpt2-ce-unblocked", 150),
    ("gpt2-ntg-remat-unroll", 150),
    ("gpt2-ntg-unroll", 150),
    ("gpt2-ntg-remat-v50304", 150),
    ("llama1b-ntg", 200),
    ("llama1b-ntg-unroll", 200),
    ("gpt2-ntg-remat-ce16k", 150),
]
MIN_SECTION_S = 40
"""A section is not started with less than this left of the budget."""


# --------------------------------------------------------------------------- driver
def run_child(name: str, args, out_dir: Path, limit: float) -> dict:
    result_file = out_dir / f".{name}.json"
    result_file.unlink(missing_ok=True)
    env = dict(os.environ)
    flags = section_flags(name)
    if flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--result",
        str(result_file),
        "--limit",
        str(limit),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--attention-cases",
        args.attention_cases,
    ]
    if args.smoke:
        cmd.append("--smoke")
    start = time.perf_counter()
    with open(out_dir / "gpu_log.txt", "a") as log:
        log.write(f"\n===== {name} (limit {limit:.0f} s, XLA_FLAGS={env.get('XLA_FLAGS', '')})\n")
        log.flush()
        try:
            done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit)
            status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timeout after {limit:.0f} s"
    seconds = round(time.perf_counter() - start, 1)
    if result_file.exists():
        result = json.loads(result_file.read_text())
        result_file.unlink()
    else:
        result = {}
    if status != "ok" and "error" not in result:
        tail = (out_dir / "gpu_log.txt").read_text().splitlines()[-12:]
        result["error"] = status + ": " + " | ".join(tail)[-1500:]
    result["status"], result["seconds"] = status if "error" not in result else "failed", seconds
    return result


def child_main(args) -> None:
    import faulthandler

    if args.limit:  # a section that hangs leaves every thread's stack in the log
        faulthandler.dump_traceback_later(max(args.limit - 4, 1), exit=False)
    try:
        result = child_function(args.child)(args)
    except BaseException as e:
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"[:2000]}
    Path(args.result).write_text(json.dumps(result, default=str))
    sys.exit(1 if "error" in result else 0)


def best_gpt2(results: dict, b64: bool = False) -> dict:
    """The fastest GPT-2 124M variant of the run at vocab 50257 (the torch side's), with its
    name: at batch 32, or with ``b64`` at batch 64 (the ``-b64`` variants)."""
    runs = [
        dict(r, name=n)
        for n, r in results.items()
        if n in GPT2_VARIANTS
        and "tokens_per_second" in r
        and "v50304" not in n
        and ("-b64" in n) == b64
    ]
    return max(runs, key=lambda r: r["tokens_per_second"], default={})


def fmt(x, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict) -> str:
    lines = []
    env = results.get("env", {})
    lines.append(
        f"GPU: {env.get('device_kind')} ({env.get('device_memory_gb')} GiB), jax {env.get('jax')}, "
        f"cuDNN {env.get('cudnn')}, torch {env.get('torch')}"
    )
    lines.append(f"{'section':22} {'status':10} {'s':>6}  result")
    for name, r in results.items():
        if name in ("env", "meta"):
            continue
        if "tokens_per_second" in r:
            what = (
                f"{r['tokens_per_second']:>10,.0f} tok/s  step {r['step_ms_median']:.1f} ms  "
                f"MFU {fmt(r.get('mfu'), '.1%')}  mem {fmt(r.get('device_peak_gb') or r.get('peak_memory_gb'))} GiB"
            )
        elif name == "attention" and r.get("cases"):
            worst = max(
                max(v.values()) for c in r["cases"] for k, v in c.items() if isinstance(v, dict)
            )
            what = (
                f"ok={r['ok']} {len(r['cases'])} cases, worst rel err {worst:.4f} (tol "
                f"{r['tolerance']}), model auto->cudnn: {r.get('model_auto_calls_cudnn')}, fallbacks: "
                + "; ".join(f"{f['case']}->{f['auto']}" for f in r.get("fallbacks", []))
            )
        elif name == "train" and "f32" in r:
            what = (
                f"ok={r['ok']} eval f32 {fmt(r['f32']['eval_loss'], '.4f')} bf16 "
                f"{fmt(r['bf16']['eval_loss'], '.4f')} max|dloss| {r['max_abs_train_loss_diff']}, "
                f"memory keys {r['memory_keys']}, device peak {r['device_peak_mb']} MB"
            )
        elif name == "resume" and "ok" in r:
            what = (
                f"ok={r['ok']} losses bitwise {r['losses_bitwise_equal']} over "
                f"{r['loss_steps_compared']} steps, final state bitwise {r['final_state_bitwise_equal']}"
            )
        else:
            what = r.get("error", "")[:200]
        lines.append(f"{name:22} {r.get('status', '-'):10} {fmt(r.get('seconds')):>6}  {what}")
    for torch_name, b64 in (("torch-gpt2", False), ("torch-gpt2-b64", True)):
        torch_r, jax_r = results.get(torch_name, {}), best_gpt2(results, b64)
        if "tokens_per_second" in torch_r and "tokens_per_second" in jax_r:
            lines.append(
                f"loomax GPT-2 ({jax_r['name']}) / torch.compile ({torch_name}): "
                f"{jax_r['tokens_per_second'] / torch_r['tokens_per_second']:.3f}x"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description="Loomax GPU checks and benchmarks")
    p.add_argument("--budget", type=float, default=450, help="seconds for all sections together")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    p.add_argument("--only", default=None, help="comma-separated sections (default: all, in order)")
    p.add_argument("--smoke", action="store_true", help="toy sizes: check the script (CPU too)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per benchmark")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--attention-cases",
        choices=("all", "documents"),
        default="all",
        help="the attention section's cases: all, or only those with document masks",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--limit", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = PLAN
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in dict(PLAN)]
        if unknown:
            p.error(f"--only: unknown section(s) {unknown}; sections: {[n for n, _ in PLAN]}")
        limits = dict(PLAN)
        plan = [("env", limits["env"])] + [(n, limits[n]) for n in wanted if n != "env"]
    deadline = time.perf_counter() + args.budget
    results: dict = {
        "meta": {
            "budget_s": args.budget,
            "smoke": args.smoke,
            "steps": args.steps,
            "gpt2_batch": GPT2_BATCH,
            "llama_batch": LLAMA_BATCH,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    }
    path = out_dir / "gpu_results.json"
    for name, limit in plan:
        left = deadline - time.perf_counter()
        if left < MIN_SECTION_S:
            results[name] = {"status": "skipped", "error": f"budget spent ({left:.0f} s left)"}
            continue
        print(f"--- {name} (up to {min(limit, left):.0f} s)", flush=True)
        results[name] = run_child(name, args, out_dir, min(limit, left))
        path.write_text(json.dumps(results, indent=1, default=str))
        print(f"    {results[name]['status']} in {results[name]['seconds']} s", flush=True)
    for torch_name, b64 in (("torch-gpt2", False), ("torch-gpt2-b64", True)):
        torch_r, jax_r = results.get(torch_name, {}), best_gpt2(results, b64)
        if "tokens_per_second" in torch_r and jax_r.get("peak_gflops"):  # the same FLOPs count
            torch_r["mfu"] = round(
                torch_r["tokens_per_second"]
                * jax_r["flops_per_token"]
                / (jax_r["peak_gflops"] * 1e9),
                4,
            )
    path.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
