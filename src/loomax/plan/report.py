"""How ``compile`` and ``plan`` show results: text, a ranked table, JSON, a YAML overlay."""

from __future__ import annotations

import re

import yaml

from loomax.plan.candidates import Candidate, as_flags, nested
from loomax.plan.compile import CompileResult
from loomax.plan.estimate import efficiency
from loomax.plan.search import Ranked
from loomax.plan.stage_loop import bubble_text

ESTIMATE_NOTE = (
    "step time and MFU are estimates, not measurements: a range (best / expected / worst) "
    "of XLA's cost model for the compiled program (scaled by loop trip counts) and the Pallas "
    "kernels' FLOPs at peak or bytes at HBM bandwidth, all at one efficiency per end "
    "({eff}), plus the collectives' bytes over the links and the MoE load; `est. step` and "
    "`est. MFU` are the expected end, ranked by it"
)
ROOFLINE_NOTE = (
    "step time and MFU are estimates, not measurements or a cost model: a range (best / "
    "expected / worst) of a roofline (the executed matmul FLOPs at the GPU's dense bf16 peak "
    "or the bytes of the step's arguments, results and temporaries at its HBM bandwidth, "
    "whichever is longer) at {eff} of it (the best end a lower bound on the step; the others "
    "fitted to H200 measurements, docs/planning.md), plus the collectives' bytes over NVLink "
    "or the network and the MoE load; `est. step` and `est. MFU` are the expected end, "
    "ranked by it"
)

BUBBLE_NOTE = (
    "bubble f/c (estimates, not measurements): the idle share of a staged candidate's pipeline "
    "by its schedule's formula / as the compiled loop's FLOP count implies (idle slots and, "
    "for 1f1b, interleaved_1f1b and zero_bubble, every slot counted at its costliest branch); "
    "the estimated step counts the latter"
)


def estimate_note(results: list[CompileResult | None]) -> str:
    """What the estimates of ``results`` are: XLA's cost model, or a roofline, and the
    efficiencies at each end of the range."""
    roofline = any(r is not None and r.estimate == "roofline" for r in results)
    platform = next((r.platform for r in results if r is not None), "tpu")
    eff = efficiency(platform)
    ends = f"{eff.best:.0%} / {eff.expected:.0%} / {eff.worst:.0%}"
    return (ROOFLINE_NOTE if roofline else ESTIMATE_NOTE).format(eff=ends)


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
    if result.pipeline:
        lines.append(bubble_text(result.pipeline))
    lines += estimate_lines(result)
    if result.measured_step_s is not None:
        mfu = f", MFU {result.measured_mfu:.1%}" if result.measured_mfu is not None else ""
        lines.append(
            f"measured: step time {fmt_seconds(result.measured_step_s)} (median of real steps "
            f"on these devices){mfu}  [measurement, not an estimate]"
        )
    lines.append(f"compile time {result.compile_s:.1f} s")
    if result.error:
        lines.append(result.error)
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"note: {estimate_note([result])}")
    return "\n".join(lines)


def estimate_lines(result: CompileResult) -> list[str]:
    """The estimated range (best / expected / worst) and its assumptions, for ``compile``."""
    if result.est_step_s is None:
        return []
    ends = (result.est_best_s, result.est_step_s, result.est_worst_s)
    if any(e is None for e in ends):  # a report from before the range: one figure
        ends = (result.est_step_s,) * 3
    tag = (
        "  [estimate; best = roofline lower bound]"
        if result.estimate == "roofline"
        else "  [estimate]"
    )
    lines = [
        "estimated step time (best / expected / worst): "
        + " / ".join(_precise(e) for e in ends)
        + tag,
        "estimated tokens/s: " + " / ".join(f"{result.tokens_per_step / e:,.0f}" for e in ends),
    ]
    mfus = (result.est_best_mfu, result.est_mfu, result.est_worst_mfu)
    if all(m is not None for m in mfus):
        lines.append(
            "estimated MFU: " + " / ".join(f"{m:.1%}" for m in mfus) + " (causal attention as half)"
        )
    if result.assumptions:
        lines.append("assumptions:")
        lines += [f"  - {a}" for a in result.assumptions]
    return lines


def _precise(s: float) -> str:
    """Seconds to three figures (a tiny test model's step is microseconds)."""
    if s >= 10:
        return f"{s:.1f} s"
    return f"{s * 1e3:.4g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def mfu_range(result: CompileResult) -> str:
    """``worst-best%`` of a result's estimated MFU, ``-`` without one."""
    if result.est_worst_mfu is None or result.est_best_mfu is None:
        return "-"
    return f"{result.est_worst_mfu:.0%}-{result.est_best_mfu:.0%}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def plan_table(ranked: list[Ranked]) -> str:
    """Candidates as ranked, one row each; ``kernels`` is the share of the estimated step
    time that is Pallas kernels' (``loomax.plan.compile.kernel_seconds``). Where a candidate
    is staged, ``bubble f/c`` is its pipeline bubble by the schedule's formula and as the
    compiled loop's count implies (estimates, ``plan/stage_loop.py``)."""
    w = max([34, *(len(r.candidate.label) for r in ranked)])
    staged = any(r.result is not None and r.result.pipeline for r in ranked)
    header = (
        f"{'#':>2}  {'strategy':<{w}} {'state':>10} {'temp':>10} {'total':>10}  "
        f"{'fits':<20} {'est. step':>10} {'est. MFU':>8} {'range':>9} {'kernels':>7} {'compile':>8}"
        + (f" {'bubble f/c':>13}" if staged else "")
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
        spread = mfu_range(res) if res.fits is not False else "-"
        step = fmt_seconds(res.est_step_s) if res.fits is not False else "-"
        kernels = (
            f"{res.est_kernel_s / res.est_step_s:.0%}"
            if res.est_step_s and res.fits is not False
            else "-"
        )
        rows.append(
            f"{i:>2}  {r.candidate.label:<{w}} {_g(res.state_bytes):>10} "
            f"{_g(res.temp_bytes) if res.compiled else '-':>10} {_g(res.total_bytes):>10}  "
            f"{fits:<20} {step:>10} {mfu:>8} {spread:>9} {kernels:>7} "
            + (f"{res.compile_s:>7.1f}s" if res.compiled else f"{'-':>8}")
            + (f" {_bubbles(res.pipeline):>13}" if staged else "")
        )
    if staged:
        rows.append(BUBBLE_NOTE)
    return "\n".join(rows)


def _bubbles(pipeline: dict | None) -> str:
    """``formula/counted`` bubble of a staged candidate (``-`` unstaged)."""
    if not pipeline:
        return "-"
    counted = pipeline.get("counted")
    return f"{pipeline['formula']:.1%}/" + ("?" if counted is None else f"{counted:.1%}")


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
            f"; estimated MFU {res.est_mfu:.1%} (range {mfu_range(res)}; {estimate_note([res])})"
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
