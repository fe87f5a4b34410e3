"""How ``compile`` and ``plan`` show results: text, a ranked table, JSON, a YAML overlay."""

from __future__ import annotations

import re

import yaml

from loomax.plan.candidates import Candidate, as_flags, nested
from loomax.plan.compile import KERNEL_PEAK_FRACTION, CompileResult
from loomax.plan.search import Ranked

ESTIMATE_NOTE = (
    "step time and MFU are estimates from XLA's cost model for the compiled program "
    "(scaled by loop trip counts; Pallas kernels' FLOPs at an assumed "
    f"{KERNEL_PEAK_FRACTION:.0%} of peak or their bytes at HBM bandwidth), not measurements"
)
ROOFLINE_NOTE = (
    "step time is a roofline lower bound, not a measurement or a cost model: the executed "
    "matmul FLOPs at the GPU's dense bf16 peak or the bytes of the step's arguments, results "
    "and temporaries at its HBM bandwidth, whichever is longer (no communication, no kernel "
    "below peak); MFU is an upper bound"
)


def estimate_note(results: list[CompileResult | None]) -> str:
    """What the estimates of ``results`` are: XLA's cost model, or a roofline lower bound."""
    if any(r is not None and r.estimate == "roofline" for r in results):
        return ROOFLINE_NOTE
    return ESTIMATE_NOTE


def gib(n: int | None) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    if n is None:
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def verdict(result: CompileResult) -> str:
    """FITS, DOES NOT FIT (by how much) or UNKNOWN (no memory size for the device)."""
    if result.fits is None:
        return "UNKNOWN (device memory size not known)"
    if result.fits:
        return "FITS"
    if not result.compiled:
        return f"DOES NOT FIT (the state and batch alone are over by {gib(result.over_bytes)})"
    return f"DOES NOT FIT (over by {gib(result.over_bytes)})"


def compile_text(result: CompileResult) -> str:
    """The report of ``loomax compile``."""
    mesh = " x ".join(f"{k} {v}" for k, v in result.mesh.items())
    device = "GPU" if result.platform == "gpu" else "chip"
    limit = gib(result.hbm_bytes) if result.hbm_bytes else "unknown"
    if result.memory_fraction is not None and result.hbm_bytes:
        limit += (
            f" ({result.memory_fraction:.0%} of {gib(int(result.hbm_bytes / result.memory_fraction))}:"
            " XLA_PYTHON_CLIENT_MEM_FRACTION)"
        )
    lines = [
        f"topology {result.topology}: {result.devices} x {result.chip}, mesh {mesh}",
        f"model: {result.params / 1e6:,.1f}M parameters, {result.tokens_per_step:,} tokens/step "
        f"in {result.microbatches} microbatch(es)",
        f"memory per {device}:",
        f"  state (params + optimizer) {gib(result.state_bytes):>12}",
        f"  batch                      {gib(result.batch_bytes):>12}",
        f"  temporaries                {gib(result.temp_bytes) if result.compiled else 'not compiled':>12}",
        f"  total (XLA)                {gib(result.total_bytes):>12}  of {limit}",
    ]
    if result.host_bytes:
        lines.append(f"  offloaded to host          {gib(result.host_bytes):>12}")
    lines.append(verdict(result))
    lines.append(
        f"FLOPs/step: {result.model_flops:.3e} model (3 x forward, causal attention as half), "
        f"{result.step_flops:.3e} executed matmuls (with remat)"
    )
    if result.est_step_s is not None:
        tps = result.tokens_per_step / result.est_step_s
        if result.estimate == "roofline":
            mfu = f", MFU <= {result.est_mfu:.1%}" if result.est_mfu is not None else ""
            lines.append(
                f"step time >= {fmt_seconds(result.est_step_s)} (<= {tps:,.0f} tokens/s){mfu}"
                "  [roofline lower bound]"
            )
        else:
            mfu = f", MFU {result.est_mfu:.1%}" if result.est_mfu is not None else ""
            lines.append(
                f"estimated step time {fmt_seconds(result.est_step_s)} ({tps:,.0f} tokens/s){mfu}  [estimate]"
            )
    if result.measured_step_s is not None:
        lines.append(f"measured step time {fmt_seconds(result.measured_step_s)} (median)")
    lines.append(f"compile time {result.compile_s:.1f} s")
    if result.error:
        lines.append(result.error)
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"note: {estimate_note([result])}")
    return "\n".join(lines)


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def plan_table(ranked: list[Ranked]) -> str:
    """Candidates as ranked, one row each; ``kernels`` is the share of the estimated step
    time that is Pallas kernels' (``loomax.plan.compile.kernel_seconds``)."""
    w = max([34, *(len(r.candidate.label) for r in ranked)])
    header = (
        f"{'#':>2}  {'strategy':<{w}} {'state':>10} {'temp':>10} {'total':>10}  "
        f"{'fits':<20} {'est. step':>10} {'est. MFU':>8} {'kernels':>7} {'compile':>8}"
    )
    rows = [header, "-" * len(header)]
    for i, r in enumerate(ranked, 1):
        res = r.result
        if res is None:
            error = _GLOG.sub("", (r.error or "").removeprefix("CompileCrash: "))
            what = "" if r.skipped else "failed: "
            rows.append(f"{i:>2}  {r.candidate.label:<{w}} {what}{error[:100]}")
            continue
        tight = res.hbm_bytes and res.total_bytes > 0.97 * res.hbm_bytes
        fits = (
            ("yes (tight)" if tight else "yes")
            if res.fits
            else "?"
            if res.fits is None
            else f"no, {'' if res.compiled else 'state '}+{res.over_bytes / 2**30:.1f} GiB"
        )
        mfu = f"{res.est_mfu:.1%}" if res.est_mfu is not None and res.fits is not False else "-"
        step = fmt_seconds(res.est_step_s) if res.fits is not False else "-"
        kernels = (
            f"{res.est_kernel_s / res.est_step_s:.0%}"
            if res.est_step_s and res.fits is not False
            else "-"
        )
        rows.append(
            f"{i:>2}  {r.candidate.label:<{w}} {_g(res.state_bytes):>10} "
            f"{_g(res.temp_bytes) if res.compiled else '-':>10} {_g(res.total_bytes):>10}  "
            f"{fits:<20} {step:>10} {mfu:>8} {kernels:>7} "
            + (f"{res.compile_s:>7.1f}s" if res.compiled else f"{'-':>8}")
        )
    return "\n".join(rows)


_GLOG = re.compile(r"[FEWI]\d{4} [\d:.]+\s+\d+ ")  # glog's line prefix in XLA's messages


def _g(n: int) -> str:
    return f"{n / 2**30:.2f}G" if n >= 2**30 else f"{n / 2**20:.1f}M"


def best(ranked: list[Ranked]) -> Ranked | None:
    """The fastest candidate that fits (None when none does)."""
    for r in ranked:
        if r.result is not None and r.result.fits is not False:
            return r
    return None


def overlay_yaml(choice: Ranked, run: str, topology: str, count: int) -> str:
    """The best candidate's keys as a YAML overlay, with how to use it."""
    res = choice.result
    flags = " ".join(as_flags(choice.candidate.overrides))
    head = [
        f"# loomax plan for {topology}: best of {count} candidates for {run}",
        f"# strategy: {choice.candidate.label}; per {'GPU' if res.platform == 'gpu' else 'chip'} "
        f"{gib(res.total_bytes)} of {gib(res.hbm_bytes)}"
        + (
            f"; estimated MFU {'at most ' if res.estimate == 'roofline' else ''}"
            f"{res.est_mfu:.1%} ({estimate_note([res])})"
            if res.est_mfu
            else ""
        ),
        "# use: loomax train --config_path RUN.yaml --overlay THIS_FILE",
        f"# (the same as the flags {flags}),",
        "# or copy these keys into the run's trainer and model sections",
    ]
    body = yaml.safe_dump(nested(choice.candidate.overrides), sort_keys=False)
    return "\n".join(head) + "\n" + body


def plan_json(ranked: list[Ranked]) -> list[dict]:
    return [
        {
            "label": r.candidate.label,
            "overrides": r.candidate.overrides,
            "result": r.result.to_json() if r.result else None,
            "error": r.error,
        }
        for r in ranked
    ]


def ranked_from_json(data: list[dict]) -> list[Ranked]:
    """``plan_json``'s output read back (e.g. to print a saved plan's table again)."""
    return [
        Ranked(
            Candidate(d["label"], d["overrides"]),
            CompileResult(**d["result"]) if d["result"] else None,
            d["error"],
        )
        for d in data
    ]
