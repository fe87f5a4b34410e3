"""``loomax plan``'s search: compile every candidate, rank them by estimated step time.

Four rounds, as a researcher would go: every mesh shape and mapping with the run's own
remat policy and batch split (for deep models, pipeline stages under each schedule first,
``plan/stage_strategies.py``; at long sequence lengths, context parallelism; a mesh
whose data-parallel devices cannot split the batch is reported, not compiled); then, for the two best so far, the other remat policies;
then, for the two best after that, 2, 4 or 8 microbatches; then, for the best, the optimizer
state in host memory (streamed, or updated there; two candidates are kept for this round).
Candidates compile in parallel (``jobs``), each in its own child process when the run's
flags are given (a compiler crash then costs one candidate).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from dataclasses import dataclass

from tqdm import tqdm

from loomax.lm.config import TrainLmConfig
from loomax.mesh import MeshConfig
from loomax.plan.candidates import (
    OFFLOAD_CANDIDATES,
    OFFLOAD_KEYS,
    Candidate,
    as_flags,
    batch_split_error,
    context_strategies,
    mesh_strategies,
    microbatch_variants,
    num_experts_of,
    offload_variants,
    remat_of,
    remat_variants,
    run_default,
)
from loomax.plan.compile import CompileResult, compile_run
from loomax.plan.stage_strategies import stage_strategies
from loomax.plan.topology import Topology
from loomax.plan.worker import compile_isolated

logger = logging.getLogger(__name__)


@dataclass
class Ranked:
    """A candidate and what compiling it told (``result`` None: it could not be built)."""

    candidate: Candidate
    result: CompileResult | None
    error: str | None = None
    skipped: bool = False
    """Not compiled: the run would refuse it (``error`` says why); ranked last, never varied."""

    @property
    def sort_key(self) -> tuple:
        r = self.result
        if self.skipped:
            return (4, 0.0)
        if r is None:
            return (3, 0.0)
        if r.fits is False:  # by how much; those whose state alone exceeds (not compiled) last
            return (2, r.over_bytes) if r.compiled else (2.5, r.over_bytes)
        # XLA's cost model leaves out host transfers and host compute: a candidate that offloads
        # (optimizer state or parameters) comes after every one that fits as well without
        offloads = any(self.candidate.overrides.get(k) for k in OFFLOAD_KEYS)
        est = r.est_step_s if r.est_step_s is not None else float("inf")
        return (0 if r.fits else 1, offloads, est)

    @property
    def refine_key(self) -> tuple:
        """Which candidates to vary next: those that fit, then those that failed to compile
        (unknown: another policy may compile and fit), then by how much the rest exceed
        (last those whose state alone exceeds: no remat policy or batch split helps them)."""
        key = self.sort_key
        if self.skipped:
            return key
        return (1, 0.0) if key[0] == 3 else (2, key[1]) if key[0] == 2 else key


def _one_stack(config) -> bool:
    """Whether the model is one stack of layers with nothing reading its output inside the
    loop, as the explicit schedules need (no dense first layers, no multi-token prediction)."""
    moe = getattr(config.model, "moe", None)
    dense_first = moe is not None and getattr(moe, "first_dense_layers", 0) > 0
    return not dense_first and not getattr(config.model, "mtp_depth", 0)


def default_jobs() -> int:
    """Parallel compiles: half the cores, and no more than one per 8 GiB of free memory."""
    cores = max(1, (os.cpu_count() or 1) // 2)
    try:
        with open("/proc/meminfo") as f:
            free = {line.split(":")[0]: int(line.split()[1]) for line in f}["MemAvailable"] * 1024
        cores = min(cores, max(1, free // (8 * 2**30)))
    except (OSError, KeyError, ValueError):
        pass
    return min(cores, 4)


def compile_all(
    config: TrainLmConfig,
    topology: Topology,
    candidates: list[Candidate],
    *,
    jobs: int = 1,
    progress: bool = True,
    desc: str = "compiling",
    config_args: list[str] | None = None,
    load_max: float | None = None,
) -> list[Ranked]:
    """Compile each candidate on ``topology``; the results in candidate order.

    With ``config_args`` (the run's ``--config_path``/override flags) each compile runs in a
    child process (``loomax.plan.worker``), so a compiler crash costs only that candidate.
    ``load_max``: a measured MoE load for the estimates (``compile_run``).
    """
    extra = {"load_max": load_max} if load_max is not None else {}

    def one(candidate: Candidate) -> Ranked:
        try:
            if config_args is not None:
                flags = config_args + as_flags(candidate.overrides)
                return Ranked(candidate, compile_isolated(flags, topology.name, **extra))
            return Ranked(candidate, compile_run(candidate.apply(config), topology, **extra))
        except Exception as e:  # noqa: BLE001 - a candidate that cannot be built is reported, not fatal
            logger.debug("candidate %s failed", candidate.label, exc_info=True)
            return Ranked(candidate, None, f"{type(e).__name__}: {e}".splitlines()[0][:200])

    bar = tqdm(total=len(candidates), desc=desc, disable=not progress, leave=False)
    try:
        if jobs <= 1:
            out = []
            for candidate in candidates:
                bar.set_postfix_str(candidate.label)
                out.append(one(candidate))
                bar.update()
            return out
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            futures = [pool.submit(one, c) for c in candidates]
            for _ in concurrent.futures.as_completed(futures):
                bar.update()
            return [f.result() for f in futures]
    finally:
        bar.close()


def search(
    config: TrainLmConfig,
    topology: Topology,
    *,
    jobs: int = 1,
    refine: int = 2,
    max_candidates: int = 24,
    progress: bool = True,
    config_args: list[str] | None = None,
    load_max: float | None = None,
) -> list[Ranked]:
    """Every candidate compiled and ranked: fitting ones by estimated step time (the
    expected end of the range), then the
    ones that do not fit by how much they exceed, then those that failed to build."""
    first = [run_default(config, topology.num_devices)]
    seen = {_key(first[0])}
    experts = num_experts_of(config)
    batch = config.trainer.batch_schedule.sizes[0]
    long = context_strategies(
        topology.num_devices, topology.num_slices, config.model.seq_len, batch=batch
    )
    layers = getattr(config.model, "num_layers", 0)
    staged = stage_strategies(
        topology.num_devices, topology.num_slices, layers, batch, explicit=_one_stack(config)
    )
    for c in [
        *staged,
        *long,
        *mesh_strategies(topology.num_devices, topology.num_slices, num_experts=experts),
    ]:
        if _key(c) not in seen:
            seen.add(_key(c))
            first.append(c)
    first = first[:max_candidates]
    common = {
        "jobs": jobs, "progress": progress, "config_args": config_args, "load_max": load_max
    }  # fmt: skip
    # a batch the data-parallel devices cannot split: reported, not compiled
    unsplit = [Ranked(c, None, batch_split_error(c, config), skipped=True) for c in first]
    unsplit = [r for r in unsplit if r.error]
    first = [c for c in first if batch_split_error(c, config) is None]
    ranked = unsplit + compile_all(config, topology, first, desc="strategies", **common)
    budget = max_candidates - len(first)
    reserved = min(len(OFFLOAD_CANDIDATES) - 1, budget)  # the best's offload variants
    budget -= reserved
    for desc, variants in (
        ("remat policies", remat_variants),
        ("microbatches", microbatch_variants),
        ("host offload", offload_variants),
    ):
        if variants is offload_variants:
            budget += reserved
        # the best so far, even failed ones (another remat policy may be what they need);
        # for microbatches, the best of each remat policy (one may crash or not fit alone)
        best = sorted(ranked, key=lambda r: r.refine_key)
        if variants is microbatch_variants:
            best = list({_policy(r.candidate, config): r for r in reversed(best)}.values())[::-1]
            best.sort(key=lambda r: r.refine_key)
        best = [r for r in best if not r.skipped][: 1 if variants is offload_variants else refine]
        more = []
        for r in best:
            for c in variants(r.candidate, config, platform=topology.platform):
                if _key(c) not in seen and len(more) < budget:
                    seen.add(_key(c))
                    more.append(c)
        if more:
            budget -= len(more)
            ranked += compile_all(config, topology, more, desc=desc, **common)
    return sorted(ranked, key=lambda r: r.sort_key)


def _policy(candidate: Candidate, config: TrainLmConfig) -> str:
    return repr(remat_of(candidate, config))


def _key(candidate: Candidate) -> str:
    """The same for candidates that set the same keys alike (a mesh with every axis named)."""
    overrides = dict(candidate.overrides)
    if isinstance(overrides.get("trainer.mesh"), dict):
        overrides["trainer.mesh"] = MeshConfig(**overrides["trainer.mesh"]).as_dict()
    return repr(sorted((k, repr(v)) for k, v in overrides.items()))
