"""bench/gpu.py's ``env`` and ``attention`` sections (each runs in its own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPT2_BATCH = 32
LLAMA_BATCH = 8


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

    from loomax.models.attention.attention import (
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
