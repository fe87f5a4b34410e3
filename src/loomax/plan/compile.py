"""Compile a run's step for a topology and report memory per chip, FLOPs and an estimated speed.

Memory is XLA's own account of the compiled program (``memory_analysis``) plus the state's
shard sizes. The step time is an *estimate*, a range (best / expected / worst) whose
assumptions the report names (``loomax.plan.estimate``): all compute at its ideal time,
XLA's ops by XLA's cost model (``optimal_seconds``, scaled by the loop trip counts XLA's
cost analysis leaves out, see ``loomax.plan.flops``) and each Pallas kernel (a custom call
XLA counts as almost free) by its FLOPs at peak or its bytes at HBM bandwidth, then one
efficiency for all of it; a load-imbalance term for mixtures of experts; and the compiled
program's collectives over the topology's links (``loomax.plan.collectives``).
Where XLA has no cost model (GPUs compiled without a GPU: ``cost_analysis()`` is None) the
ideal is a roofline: the executed matmul FLOPs at the device's peak or the bytes of the
program's arguments, results and temporaries at its HBM bandwidth.
Never a measurement; the MFU it implies is only as good as that model.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from dataclasses import asdict, dataclass, field

import jax

from loomax.lm.config import TrainLmConfig
from loomax.lm.weights import initial_model
from loomax.plan.build import built_step
from loomax.plan.collectives import Traffic, communication, traffic
from loomax.plan.estimate import Inputs, efficiency, estimate
from loomax.plan.flops import StepCount, count_step
from loomax.plan.ideal import ideal_seconds, kernel_seconds
from loomax.plan.stage_loop import pipeline_bubble
from loomax.plan.topology import Topology
from loomax.stages import STAGE_AXIS


@dataclass
class CompileResult:
    """What compiling one configuration for one topology tells (bytes and FLOPs per device)."""

    topology: str
    devices: int
    mesh: dict[str, int]
    chip: str | None
    hbm_bytes: int | None
    """Memory a run may use on one device (None: unknown)."""
    state_bytes: int = 0
    """Parameters, optimizer state and extras: the sum of this device's shards."""
    batch_bytes: int = 0
    temp_bytes: int = 0
    """XLA's temporaries (activations, gradients, buffers) on one device."""
    host_bytes: int = 0
    """Host memory the program uses per device (offloaded activations)."""
    total_bytes: int = 0
    """Peak device memory: arguments + outputs - donated + temporaries + code."""
    fits: bool | None = None
    params: int = 0
    tokens_per_step: int = 0
    microbatches: int = 1
    model_flops: float = 0.0
    """Model FLOPs per step, all devices (3 x forward, causal attention as half the score
    matrix: what MFU counts)."""
    step_flops: float = 0.0
    """Matmul FLOPs the step executes, all devices (with rematerialized passes)."""
    kernel_flops: float = 0.0
    """FLOPs of the Pallas kernels (e.g. splash attention) in ``step_flops``, from their math."""
    est_step_s: float | None = None
    """Estimated step time, the range's expected end (``loomax.plan.estimate``; not a
    measurement)."""
    est_kernel_s: float = 0.0
    """Part of ``est_step_s`` that is the Pallas kernels' (at the same efficiency as the rest)."""
    est_mfu: float | None = None
    """MFU at ``est_step_s``."""
    est_best_s: float | None = None
    """The range's best end: compute at its ideal speed, communication hidden, MoE load even."""
    est_worst_s: float | None = None
    """The range's worst end: compute at the worst efficiency, communication all exposed,
    MoE load at its bound and every recompute branch taken."""
    est_best_mfu: float | None = None
    est_worst_mfu: float | None = None
    assumptions: list[str] = field(default_factory=list)
    """What the range assumes, one line each (compute, MoE load, communication, left out)."""
    comm_bytes: float = 0.0
    """Bytes one device sends a step for the program's collectives (``plan/collectives.py``)."""
    comm_overlapped_bytes: float = 0.0
    """The part of ``comm_bytes`` the schedule overlaps with compute."""
    comm_s: float = 0.0
    """``comm_bytes`` over the topology's links, seconds (0 where the links are unknown)."""
    load_max: float | None = None
    """A measured MoE load (busiest expert over the mean) the estimate used, if given."""
    compile_s: float = 0.0
    measured_step_s: float | None = None
    """The median of real steps on the local devices (``--measure``): a measurement, kept
    apart from the estimate."""
    measured_mfu: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    platform: str = "tpu"
    """The devices' platform: ``tpu``, ``gpu`` or ``cpu``."""
    memory_fraction: float | None = None
    """The part of the device's memory ``hbm_bytes`` is (GPUs: JAX preallocates 75%)."""
    compiled: bool = True
    """False where the step was not compiled (its state alone cannot fit)."""
    estimate: str = "cost model"
    """How ``est_step_s`` was found: ``cost model`` (XLA's) or ``roofline`` (a lower bound)."""
    pipeline: dict | None = None
    """A staged step's schedule, microbatches, loop slots and bubble, as estimates
    (``plan/stage_loop.py``'s ``PipelineBubble``); None without stages."""

    @property
    def over_bytes(self) -> int:
        """By how much the program exceeds the device's memory (0 when it fits)."""
        return max(0, self.total_bytes - (self.hbm_bytes or self.total_bytes))

    def to_json(self) -> dict:
        return asdict(self)


def compile_run(
    config: TrainLmConfig,
    topology: Topology,
    *,
    measure_steps: int = 0,
    load_max: float | None = None,
) -> CompileResult:
    """Build ``config``'s train step over ``topology``'s devices, compile it, and report.

    ``load_max``: a mixture of experts' measured load (``moe/layer_<i>/load_max``, the busiest
    expert over the mean) for the estimate's imbalance term; else ``model.moe.saved_rows``.

    A program XLA rejects for lack of memory comes back with ``fits=False`` (and its
    sizes, where XLA's message states them); other build errors raise ``ValueError``.
    """
    with built_step(config, topology.devices) as built:
        trainer = built.trainer
        mesh = dict(trainer.mesh.shape)
        result = CompileResult(
            topology.name,
            topology.num_devices,
            mesh,
            topology.chip.name if topology.chip else str(topology.devices[0].device_kind),
            topology.hbm_per_device,
            notes=list(built.notes),
            platform=topology.platform,
            memory_fraction=topology.memory_fraction,
            load_max=load_max,
        )
        if topology.platform == "gpu" and config.model.attn_backend == "auto":
            result.notes.append(
                "attention compiled with the pure-JAX backend auto picks without a GPU here "
                "(cuDNN's fused attention needs cuDNN and a GPU to compile); on the GPUs, auto "
                "uses cuDNN where it can serve"
            )
        result.params = config.model.param_count(built.vocab_size)
        result.tokens_per_step = math.prod(built.batch.shape)
        result.microbatches = trainer.num_microbatches
        result.model_flops = (
            3 * config.model.flops_per_token(built.vocab_size) * result.tokens_per_step
        )
        result.state_bytes = _shard_bytes(built.state)
        result.batch_bytes = _shard_bytes(built.batch)
        if _state_alone_exceeds(result, topology):
            return result
        start = time.perf_counter()
        traced = built.trace()
        count = count_step(traced.jaxpr)
        if mesh.get(STAGE_AXIS, 1) > 1:
            staged = pipeline_bubble(traced.jaxpr, config.trainer.pipeline, mesh[STAGE_AXIS])
            result.pipeline = staged.to_json()
        result.step_flops, result.kernel_flops = count.total_flops, count.kernel_flops
        worst = count_step(traced.jaxpr, with_fallbacks=True) if count.fallbacks else None
        try:
            with _no_cache_writes(topology):
                compiled = traced.lower().compile()
        except Exception as e:  # noqa: BLE001 - XLA reports "does not fit" as a compile error
            result.compile_s = time.perf_counter() - start
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            _from_oom_message(result, str(e))
            return result
        result.compile_s = time.perf_counter() - start
        _memory(result, compiled)
        moe = getattr(config.model, "moe", None)
        _estimate(result, compiled, topology, count, worst, getattr(moe, "saved_rows", None))
        if measure_steps:
            result.measured_step_s = _measure(trainer, config, built, compiled, measure_steps)
            peak = topology.peak_per_device
            if peak:
                result.measured_mfu = result.model_flops / (
                    result.measured_step_s * peak * topology.num_devices
                )
    return result


def _state_alone_exceeds(result: CompileResult, topology: Topology) -> bool:
    """Whether the state and batch alone exceed a GPU's usable memory: then the step cannot
    fit and is not compiled (XLA's GPU compiler, unlike the TPU one, would build the whole
    program before its size is known); ``result`` says so."""
    if topology.platform != "gpu" or topology.chip is None or not result.hbm_bytes:
        return False
    need = result.state_bytes + result.batch_bytes
    if need <= result.hbm_bytes:
        return False
    result.fits, result.total_bytes, result.compiled = False, need, False
    result.notes.append(
        "not compiled: the state and batch alone exceed the memory a run may use on one GPU "
        "(temporaries not counted)"
    )
    return True


def _no_cache_writes(topology: Topology):
    """Keep programs for compile-only devices out of the persistent compilation cache (this
    host could never load them back)."""
    if topology.chip is None:
        return contextlib.nullcontext()
    try:
        # private: the public jax.config.update is process-wide, this context is this thread's
        from jax._src import config as jax_config

        return jax_config.persistent_cache_min_compile_time_secs(float("inf"))
    except (ImportError, AttributeError, TypeError):  # a JAX without it: writes stay possible
        return contextlib.nullcontext()


def _shard_bytes(tree) -> int:
    """Bytes of this device's shard of every array in ``tree`` (ShapeDtypeStructs with shardings)
    that rests in device memory (offloaded state, in pinned host memory, is not counted)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if leaf.sharding is not None and leaf.sharding.memory_kind == "pinned_host":
            continue
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def _memory(result: CompileResult, compiled) -> None:
    stats = compiled.memory_analysis()
    if stats is None:
        result.notes.append("this backend gives no memory analysis")
        return
    result.temp_bytes = stats.temp_size_in_bytes
    result.host_bytes = stats.host_temp_size_in_bytes + stats.host_argument_size_in_bytes
    if stats.host_argument_size_in_bytes:  # state offloaded by trainer.offload_optimizer_state
        result.notes.append(
            f"{stats.host_argument_size_in_bytes / 2**20:,.2f} MiB of state rest in host memory: "
            "the step-time estimate leaves out their transfers and any update run on the host"
        )
    result.total_bytes = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
        + stats.generated_code_size_in_bytes
    )
    if result.hbm_bytes:
        result.fits = result.total_bytes <= result.hbm_bytes
        if result.fits and result.total_bytes > 0.97 * result.hbm_bytes:
            result.notes.append(
                "tight: within 3% of the chip's memory (XLA keeps a little of it for itself)"
            )


def _estimate(
    result: CompileResult,
    compiled,
    topology: Topology,
    count: StepCount,
    worst: StepCount | None,
    saved_rows: float | None,
) -> None:
    """The step-time range (``loomax.plan.estimate``) of ``compiled``, and its assumptions."""
    ideal = ideal_seconds(compiled, topology, count, result.notes)
    if ideal is None:
        return
    compute, base = ideal
    devices = topology.num_devices
    peak = topology.peak_per_device
    bandwidth = topology.chip.hbm_bandwidth if topology.chip else None
    kernels = [
        (k.calls / devices * kernel_seconds(k, peak, bandwidth), k.routed)
        for k in count.kernels.values()
    ]
    fallback_s = None
    if worst is not None:
        alt = ideal_seconds(compiled, topology, worst)
        fallback_s = max(0.0, alt[0] - compute) if alt else None
    moved = Traffic()
    if devices > 1:
        try:
            moved = traffic(compiled.as_text(), devices)
        except Exception:  # noqa: BLE001 - no program text: the estimate says no collectives
            result.notes.append("the compiled program's text was not readable: no collectives")
    serial_s, overlapped_s, comm_note = communication(moved, topology)
    result.comm_bytes, result.comm_overlapped_bytes = moved.bytes, moved.overlapped_bytes
    result.comm_s = serial_s + overlapped_s
    found = estimate(
        Inputs(
            compute_s=compute,
            kernel_s=sum(s for s, _ in kernels),
            routed_s=[(s, r) for s, r in kernels if r < 1],
            fallback_s=fallback_s,
            saved_rows=saved_rows,
            load_max=result.load_max,
            comm_serial_s=serial_s,
            comm_overlapped_s=overlapped_s,
            comm_note=comm_note,
            base=base,
            platform=topology.platform,
        )
    )
    result.estimate = base
    result.est_best_s, result.est_step_s, result.est_worst_s = (
        found.step_s["best"],
        found.step_s["expected"],
        found.step_s["worst"],
    )
    result.est_kernel_s = found.kernel_s
    result.assumptions = found.assumptions
    if peak:
        per_step = peak * devices

        def mfu(step: float) -> float:
            return result.model_flops / (step * per_step)

        result.est_best_mfu = mfu(result.est_best_s)
        result.est_mfu = mfu(result.est_step_s)
        result.est_worst_mfu = mfu(result.est_worst_s)
    if count.kernels and result.est_step_s:
        names = sorted({k.name.split("_segmented")[0] for k in count.kernels.values()})
        result.notes.append(
            f"{result.est_kernel_s / result.est_step_s:.0%} of the expected step time is Pallas "
            f"kernels XLA does not cost ({', '.join(names)}): their FLOPs at peak or bytes at "
            "HBM bandwidth, at the same efficiency as XLA's ops"
        )
    if worst is not None and fallback_s is not None:
        eff = efficiency(topology.platform).expected
        step = result.est_step_s + fallback_s / eff
        what = f"est. {step:.3g} s a step"
        if peak:
            what += f", MFU {result.model_flops / (step * peak * devices):.1%}"
        result.notes.append(
            "FLOPs, kernels and the expected estimate assume every device's routed rows fit "
            "the rows its MoE layers keep (model.moe.saved_rows); a device holding more "
            "recomputes its experts' forward in the backward ("
            f"{count.fallbacks:,.0f} such conditionals a step, all devices). If every one "
            f"did: {what} (the worst end counts them)"
        )


_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_USED = re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm")
_TEMPS = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def _from_oom_message(result: CompileResult, message: str) -> None:
    """Sizes from XLA's out-of-memory message, where it states them."""
    result.fits = False
    used, temps = _USED.search(message), _TEMPS.search(message)
    result.total_bytes = result.state_bytes + result.batch_bytes
    if temps:
        result.temp_bytes = int(float(temps.group(1)) * _UNIT[temps.group(2)])
        result.total_bytes += result.temp_bytes
    if used:
        result.total_bytes = max(
            result.total_bytes, int(float(used.group(1)) * _UNIT[used.group(2)])
        )
    first = message.strip().splitlines()[0] if message.strip() else message
    result.error = f"XLA: {first[:300]}"


def _measure(trainer, config, built, compiled, steps: int) -> float:
    """Median wall time of ``steps`` real steps on the local devices (random tokens)."""
    import numpy as np

    rng = np.random.default_rng(0)
    state = trainer.initial_state(initial_model(config, built.vocab_size))
    tokens = rng.integers(0, built.vocab_size, built.batch.shape, dtype=np.int32)
    batch = trainer.runtime.shard_batch(tokens)
    state, metrics = compiled(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
