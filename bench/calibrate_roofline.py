"""The GPU roofline against what was measured on an H200: measured tokens/s over estimated.

For each measured configuration of ``bench/results/gpu_h200_run1.json`` (GPT-2 124M at
32 x 1024 tokens, Llama-1B at 8 x 4096, float32 parameters, bf16 compute, no remat, one
H200), ``loomax compile`` of the same flags for ``h200:1`` (compile-only, JAX's CUDA plugin,
no GPU needed) gives the roofline, the estimate's best end; the ratio measured / roofline is
what ``loomax.plan.estimate.EFFICIENCY["gpu"]`` takes for its expected (Llama-1B) and worst
(GPT-2) ends. Both MFUs count causal attention as half the score matrix (the runs' own JSON,
written before that count, has the full square: ``mfu`` there is higher).

    python bench/calibrate_roofline.py [--out bench/results/roofline_calibration_h200.json]

Prints one line per configuration and the JSON record. The compile runs in a child
process (``loomax.plan.worker``); about 10 s for GPT-2 and 25 s for Llama-1B on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = "bench/results/gpu_h200_run1.json"
CASES = (("gpt2-124m", "gpt2"), ("llama-1b", "llama1b"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "bench/results/roofline_calibration_h200.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from loomax.plan.gpus import GPUS
    from loomax.plan.worker import compile_isolated, setup_compile_only

    setup_compile_only("h200:1")
    runs = json.loads((REPO / RUN).read_text())
    peak = GPUS["h200"].peak_bf16
    cases = []
    for model, key in CASES:
        run = runs[key]
        flags = run["config"].split()
        config_args = ["--config_path", flags[0], *flags[1:]]
        result = compile_isolated(config_args, "h200:1")
        tokens = result.tokens_per_step
        roofline = tokens / result.est_best_s
        measured = run["tokens_per_second"]
        per_token = result.model_flops / tokens
        case = {
            "model": model,
            "config": run["config"],
            "measured_from": RUN,
            "measured_key": key,
            "measured_tokens_per_second": measured,
            "measured_step_ms": run["step_ms_median"],
            "measured_mfu_causal": round(measured * per_token / peak, 4),
            "roofline_tokens_per_second": round(roofline, 1),
            "roofline_step_ms": round(result.est_best_s * 1e3, 2),
            "roofline_mfu_causal": round(result.est_best_mfu, 4),
            "roofline_bound": next((n for n in result.notes if "roofline, bound by" in n), ""),
            "model_flops_per_token_causal": per_token,
            "executed_flops_per_token": result.step_flops / tokens,
            "ratio": round(measured / roofline, 4),
        }
        cases.append(case)
        print(
            f"{model}: measured {measured:,.0f} tokens/s (MFU {case['measured_mfu_causal']:.1%}, "
            f"a measurement) / roofline {roofline:,.0f} tokens/s (MFU "
            f"{case['roofline_mfu_causal']:.1%}, an estimate) = {case['ratio']:.3f}"
        )
    record = {
        "what": "measured tokens/s on one H200 over the roofline estimate of the same config "
        "(loomax compile --topology h200:1, compile-only); MFU counts causal attention as half",
        "gpu": "h200",
        "attention_note": "the compile-only program attends with the pure-JAX backend (cuDNN "
        "needs a GPU to compile); the measured runs used cuDNN",
        "cases": cases,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
