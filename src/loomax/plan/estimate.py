"""A step-time estimate as a range (best / expected / worst), with what each end assumes.

Three terms, each stated in the report (``Estimate.assumptions``):

- **compute**: every op alike, what XLA compiles and the Pallas kernels it does not cost,
  at its *ideal* time (XLA's ops: its cost model, scaled by the loop trip counts it leaves
  out and never below the roofline of their matmul FLOPs at peak and bytes at HBM bandwidth;
  without a cost model, GPUs compiled without one: that roofline; a kernel: its FLOPs at
  peak or its bytes at HBM bandwidth, whichever is longer), divided by one efficiency per
  end of the range (``EFFICIENCY``): the same for XLA's ops and for kernels.
- **load imbalance** (mixtures of experts under expert parallelism): a grouped-matmul
  kernel on a partly filled buffer is counted for the mean routed rows; the step waits for
  the busiest device, so its time is scaled by the busiest device's load over the mean
  (``load_max`` measured by a run, ``moe/layer_<i>/load_max``, else ``model.moe.saved_rows``,
  the rows a layer keeps; worst: the larger of them, or with neither, the whole dropless
  buffer), and where that exceeds the kept rows every layer's recompute branch is counted.
- **communication**: the bytes each device sends for the compiled program's collectives
  (``plan/collectives.py``) over the topology's link bandwidth (``Topology.link_per_device``;
  groups larger than a slice or GPU host at the bandwidth between them). Best: hidden
  behind compute; expected: what the schedule overlaps (asynchronous, compute between start
  and done) hidden, the rest added; worst: all of it added.

Never a measurement: the report sets a measured step apart (``measured_step_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BEST, EXPECTED, WORST = "best", "expected", "worst"
ENDS = (BEST, EXPECTED, WORST)


@dataclass(frozen=True)
class Efficiency:
    """The share of its ideal speed compute runs at, at each end of the range."""

    best: float
    expected: float
    worst: float
    source: str


EFFICIENCY = {
    "gpu": Efficiency(
        1.0,
        0.48,
        0.25,
        "fitted to the H200 measurements (bench/results/gpu_h200_run1.json): Llama-1B ran at "
        "0.48 of its roofline, GPT-2 124M at 0.25 (docs/planning.md, 'Calibration'), so "
        "those two lie inside the range by construction",
    ),
    "tpu": Efficiency(
        1.0,
        0.85,
        0.65,
        "assumed, not calibrated (no TPU step measured here): XLA's TPU cost model already "
        "prices each op's non-matmul work; 0.65 is MaxText's published v5p long-context "
        "MFU (Llama-3.1-8B, 65-70%), the low end",
    ),
    "cpu": Efficiency(1.0, 0.5, 0.25, "assumed (local CPU devices: no interconnect figure)"),
}
"""Efficiency of all compute (XLA's ops and Pallas kernels alike) by platform."""


def efficiency(platform: str) -> Efficiency:
    return EFFICIENCY.get(platform, EFFICIENCY["cpu"])


@dataclass
class Inputs:
    """What one compiled step gives the estimate, seconds on one device."""

    compute_s: float
    """Ideal compute: XLA's part and the kernels' at their ideal speed."""
    kernel_s: float = 0.0
    """The kernels' part of ``compute_s``."""
    routed_s: list[tuple[float, float]] = field(default_factory=list)
    """Ideal seconds of each kernel on a partly filled buffer, with its routed share."""
    fallback_s: float | None = None
    """Ideal seconds every recompute branch (kept-rows fallback) adds, None without any."""
    saved_rows: float | None = None
    load_max: float | None = None
    comm_serial_s: float = 0.0
    comm_overlapped_s: float = 0.0
    comm_note: str | None = None
    """What the communication term is (bytes, bandwidth), or why there is none."""
    base: str = "cost model"
    """``cost model`` (XLA's) or ``roofline`` (no cost model: FLOPs at peak or bytes)."""
    platform: str = "tpu"


@dataclass
class Estimate:
    """Step seconds at each end of the range, and the assumptions, named."""

    step_s: dict[str, float]
    kernel_s: float
    assumptions: list[str]


def estimate(inputs: Inputs) -> Estimate:
    """The range of ``inputs``' step time, and what each end assumes."""
    eff = efficiency(inputs.platform)
    loads = _loads(inputs)
    steps = {}
    for end in ENDS:
        load, fallback = loads[end]
        compute = inputs.compute_s + sum(s * (min(load, 1 / r) - 1) for s, r in inputs.routed_s)
        if fallback and inputs.fallback_s:
            compute += inputs.fallback_s
        compute /= getattr(eff, end)
        comm = inputs.comm_serial_s + inputs.comm_overlapped_s
        if end == BEST:
            steps[end] = max(compute, comm)
        elif end == EXPECTED:
            steps[end] = max(compute, inputs.comm_overlapped_s) + inputs.comm_serial_s
        else:
            steps[end] = compute + comm
    return Estimate(steps, inputs.kernel_s / eff.expected, _assumptions(inputs, eff, loads))


def _loads(inputs: Inputs) -> dict[str, tuple[float, bool]]:
    """The busiest device's load over the mean, and whether the recompute branch runs, at
    each end."""
    kept, measured = inputs.saved_rows, inputs.load_max
    expected = measured if measured is not None else (kept if kept is not None else 1.0)
    given = [x for x in (measured, kept) if x is not None]
    worst = max(given) if given else float("inf")  # neither: the whole dropless buffer
    return {
        BEST: (1.0, False),
        EXPECTED: (expected, kept is not None and expected > kept),
        WORST: (worst, kept is not None),
    }


def _assumptions(inputs: Inputs, eff: Efficiency, loads) -> list[str]:
    base = (
        "XLA's cost model for its ops (scaled by loop trip counts, at least the roofline of "
        "their matmul FLOPs and bytes), each Pallas kernel at its FLOPs at peak or bytes at "
        "HBM bandwidth"
        if inputs.base == "cost model"
        else "a roofline (no cost model for compile-only GPUs): the executed matmul FLOPs at "
        "peak or the step's bytes at HBM bandwidth, whichever is longer"
    )
    out = [
        f"compute: every op alike (XLA's and Pallas kernels) at {eff.best:.0%} / "
        f"{eff.expected:.0%} / {eff.worst:.0%} of its ideal speed (best / expected / worst); "
        f"ideal: {base}; efficiencies {eff.source}"
    ]
    if inputs.routed_s:
        kept, measured = inputs.saved_rows, inputs.load_max
        source = (
            f"load_max {measured:g} (measured)"
            if measured is not None
            else f"model.moe.saved_rows {kept:g} (no measured load_max)"
            if kept is not None
            else "no saved_rows or load_max: expected at the mean"
        )
        worst, _ = loads[WORST]
        worst_text = (
            "the whole dropless buffer" if worst == float("inf") else f"{worst:g}x the mean"
        )
        out.append(
            "MoE load: grouped-matmul kernels on the routed rows wait for the busiest device; "
            f"best: every device at the mean routed rows, expected: the busiest at {source}, "
            f"worst: {worst_text}"
            + (", and every layer's recompute branch (rows over the kept ones)" if kept else "")
        )
    elif inputs.fallback_s:
        out.append(
            "MoE recompute: best and expected assume every device's routed rows fit the kept "
            "rows (model.moe.saved_rows); worst: every layer's recompute branch runs"
        )
    out.append(
        inputs.comm_note
        or "communication: none counted (no collectives, or no link bandwidth for these devices)"
    )
    out.append(
        "not modelled: host transfers (offloaded state or activations), the input pipeline, "
        "launch overheads; never a measurement"
    )
    return out
