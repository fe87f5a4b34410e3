"""A mesh chosen at start (``trainer.mesh.auto``, ``trainer.force_strategy``): ``loomax plan``'s
mesh strategies compiled for the devices present, the fastest that fits taken, the choice
cached by config and device kind."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import jax

from loomax.config import ConfigError
from loomax.lm.config import TrainLmConfig
from loomax.mesh import MeshConfig
from loomax.plan.candidates import Candidate, mesh_strategies, num_experts_of
from loomax.plan.search import Ranked, compile_all
from loomax.plan.topology import Topology, get_topology

MAX_CANDIDATES = 8
"""Strategies compiled at most, in ``mesh_strategies`` order (FSDP, DP, ZeRO-2 by TP size)."""


def cache_dir() -> Path:
    """Where choices are kept: ``$LOOMAX_CACHE_DIR`` or ``~/.cache/loomax``, under ``auto_mesh``."""
    root = os.environ.get("LOOMAX_CACHE_DIR") or Path.home() / ".cache" / "loomax"
    return Path(root) / "auto_mesh"


def choose_strategy(
    config: TrainLmConfig,
    *,
    topology: Topology | None = None,
    cache: Path | None = None,
    say: Callable[[str], None] = print,
) -> TrainLmConfig:
    """``config`` with its mesh and mappings chosen, when ``trainer.mesh.auto`` is set or
    ``trainer.force_strategy`` names one; otherwise ``config`` as it is."""
    trainer = config.trainer
    if not trainer.mesh.auto and trainer.force_strategy is None:
        return config
    topology = topology or get_topology("local")
    base = dataclasses.replace(
        config, trainer=dataclasses.replace(trainer, mesh=MeshConfig(), force_strategy=None)
    )
    experts = num_experts_of(config)
    candidates = mesh_strategies(topology.num_devices, topology.num_slices, num_experts=experts)
    if trainer.force_strategy is not None:
        chosen = _named(candidates, trainer.force_strategy)
        say(f"trainer.force_strategy: {chosen.label} ({_describe(chosen)})")
        return chosen.apply(base)
    path = (cache or cache_dir()) / f"{_key(base, topology)}.json"
    if path.exists():
        saved = json.loads(path.read_text())
        chosen = _named(candidates, saved["label"])
        say(f"trainer.mesh.auto: {chosen.label} (chosen before: {saved['why']}; cache {path})")
        return chosen.apply(base)
    ranked = sorted(compile_all(base, topology, candidates[:MAX_CANDIDATES], progress=False),
                    key=lambda r: r.sort_key)  # fmt: skip
    best = ranked[0]
    if best.result is None or best.result.fits is False:
        raise ConfigError(
            f"trainer.mesh.auto: none of {len(ranked)} strategies fits the {topology.num_devices} "
            f"devices (best: {best.candidate.label}: {best.error or _why(best)}); "
            "set trainer.mesh, a smaller batch per device or more remat"
        )
    why = _why(best)
    runner_up = ranked[1] if len(ranked) > 1 else None
    if runner_up is not None:
        why += f"; next {runner_up.candidate.label}: {runner_up.error or _why(runner_up)}"
    say(f"trainer.mesh.auto: {best.candidate.label} ({_describe(best.candidate)}): {why}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"label": best.candidate.label, "why": why}))
    return best.candidate.apply(base)


def _named(candidates: list[Candidate], label: str) -> Candidate:
    for candidate in candidates:
        if candidate.label == label.strip():
            return candidate
    raise ConfigError(
        f"trainer.force_strategy: unknown strategy {label!r} for these devices; one of "
        + ", ".join(c.label for c in candidates)
    )


def _describe(candidate: Candidate) -> str:
    return ", ".join(f"{k}={v}" for k, v in candidate.overrides.items())


def _why(ranked: Ranked) -> str:
    r = ranked.result
    if r is None:
        return "did not build"
    step = f"est. step {r.est_step_s * 1e3:.3g} ms" if r.est_step_s is not None else "no estimate"
    memory = f"{r.total_bytes / 2**20:.1f} MiB per device"
    if r.hbm_bytes:
        memory += f" of {r.hbm_bytes / 2**30:.1f} GiB" + ("" if r.fits else ": does not fit")
    return f"{step}, {memory}"


def _key(config: TrainLmConfig, topology: Topology) -> str:
    """The run's config (with the mesh left out) and the devices: kind and count."""
    device = topology.devices[0]
    text = json.dumps(
        [dataclasses.asdict(config), device.platform, device.device_kind, topology.num_devices],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(f"{text}{jax.__version__}".encode()).hexdigest()[:20]
