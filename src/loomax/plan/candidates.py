"""The strategies ``loomax plan`` tries: mesh shape and mappings, microbatches, remat policy
and where the optimizer state rests (device or host memory).

A candidate is a set of config overrides (``section.key -> value``) on top of the run;
applied, it is an ordinary ``TrainLmConfig`` that ``loomax train`` would run the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from loomax.lm.config import TrainLmConfig
from loomax.mesh import MeshConfig

Overrides = dict[str, Any]


@dataclass(frozen=True)
class Candidate:
    """One strategy: a short label and the config keys it sets."""

    label: str
    overrides: Overrides

    def apply(self, config: TrainLmConfig) -> TrainLmConfig:
        """``config`` with this candidate's keys set."""
        return apply_overrides(config, self.overrides)


def apply_overrides(config: Any, overrides: Overrides) -> Any:
    """``config`` (a tree of frozen dataclasses) with each dotted key replaced by its value."""
    for key, value in overrides.items():
        config = _replace(config, key.split("."), value)
    return config


def _replace(node: Any, path: list[str], value: Any) -> Any:
    head, rest = path[0], path[1:]
    if head == "mesh" and not rest and isinstance(value, dict):
        value = MeshConfig(**value)
    new = value if not rest else _replace(getattr(node, head), rest, value)
    return dataclasses.replace(node, **{head: new})


def mesh_strategies(
    num_devices: int, num_slices: int = 1, max_model: int = 8, num_experts: int | None = None
) -> list[Candidate]:
    """Mesh shapes and mappings: FSDP, plain data parallel or ZeRO-2 (parameters whole,
    optimizer state split), each with tensor parallelism of 1, 2, 4, 8 where it divides the
    devices; slices become the ``replica`` axis. For a mixture of experts (``num_experts``),
    FSDP with expert parallelism too: ``expert`` of 2, 4, 8... where it divides both the
    data devices and the experts (label ``fsdp ep4 2x4x1``: data x expert x model)."""
    per_slice = num_devices // num_slices
    out = []
    model = 1
    while model <= min(max_model, per_slice):
        if per_slice % model == 0:
            data = per_slice // model
            mesh = {"replica": num_slices, "data": data, "expert": 1, "context": 1, "model": model}
            tp = f" tp{model}" if model > 1 else ""
            shape = f"{num_slices}x{data}x{model}" if num_slices > 1 else f"{data}x{model}"
            fsdp = {
                "trainer.mesh": mesh,
                "trainer.fsdp_axis": "embed",
                "trainer.shard_params": True,
            }
            out.append(Candidate(f"fsdp{tp} {shape}", fsdp))
            out += _expert_parallel(fsdp, num_experts, tp)
            if data > 1 or model == 1:
                out.append(
                    Candidate(f"dp{tp} {shape}", {"trainer.mesh": mesh, "trainer.fsdp_axis": None})
                )
            if data > 1:
                zero2 = {**fsdp, "trainer.shard_params": False}
                out.append(Candidate(f"zero2{tp} {shape}", zero2))
        model *= 2
    return out


CONTEXT_FROM = 16384
"""Runs with sequences at least this long also try context parallelism (``context_strategies``)."""


CONTEXT_TRIES = 3
"""Context-parallel candidates tried at most when the batch is known: the smallest splits that
serve (fewer ring hops and smaller collectives; each compile of a long-sequence step takes minutes)."""


def context_strategies(
    num_devices: int,
    num_slices: int,
    seq_len: int,
    max_context: int = 8,
    batch: int | None = None,
) -> list[Candidate]:
    """FSDP with each sequence split over ``context`` = 2, 4, 8 devices (ring attention),
    where it divides the devices of a slice and ``seq_len`` cuts into its 2 x context
    zig-zag chunks; none for sequences shorter than ``CONTEXT_FROM``.

    With ``batch`` (rows a step) known, the context sizes go up to a whole slice instead of
    ``max_context``, and only those whose data-parallel devices split the batch count: the
    ``CONTEXT_TRIES`` smallest of them (a few long rows on many chips need a wide split)."""
    if seq_len < CONTEXT_FROM:
        return []
    per_slice = num_devices // num_slices
    limit = per_slice if batch else min(max_context, per_slice)
    out = []
    context = 2
    while context <= limit and (batch is None or len(out) < CONTEXT_TRIES):
        serves = per_slice % context == 0 and seq_len % (2 * context) == 0
        if serves and batch:
            serves = batch % (num_devices // context) == 0
        if serves:
            data = per_slice // context
            mesh = {
                "replica": num_slices,
                "data": data,
                "expert": 1,
                "context": context,
                "model": 1,
            }
            shape = f"{num_slices}x{data}x{context}" if num_slices > 1 else f"{data}x{context}"
            overrides = {
                "trainer.mesh": mesh,
                "trainer.fsdp_axis": "embed",
                "trainer.shard_params": True,
            }
            out.append(Candidate(f"fsdp cp{context} {shape}", overrides))
        context *= 2
    return out


def batch_split_error(candidate: Candidate, config: TrainLmConfig) -> str | None:
    """Why ``candidate``'s data-parallel devices cannot split ``config``'s batch (the run
    would refuse it before compiling), or None when they can."""
    batch, ways = config.trainer.batch_schedule.sizes[0], data_parallel_of(candidate)
    if batch % ways == 0 or config.trainer.allow_nondivisible_batch_size:
        return None
    return (
        f"not compiled: trainer.train_batch_size ({batch}) does not split over its {ways} "
        "data-parallel devices (replica x data x expert)"
    )


def _expert_parallel(fsdp: Overrides, num_experts: int | None, tp: str) -> list[Candidate]:
    """``fsdp`` with its data devices split further by ``expert`` (2, 4, ...)."""
    mesh, out, ways = fsdp["trainer.mesh"], [], 2
    while num_experts and ways <= min(mesh["data"], num_experts):
        if mesh["data"] % ways == 0 and num_experts % ways == 0:
            data = mesh["data"] // ways
            split = {**mesh, "data": data, "expert": ways}
            shape = f"{data}x{ways}x{mesh['model']}"
            if mesh["replica"] > 1:
                shape = f"{mesh['replica']}x{shape}"
            out.append(Candidate(f"fsdp ep{ways}{tp} {shape}", {**fsdp, "trainer.mesh": split}))
        ways *= 2
    return out


def num_experts_of(config: TrainLmConfig) -> int | None:
    """The experts of a mixture-of-experts model (for its expert-parallel strategies); None
    for a dense one."""
    moe = getattr(config.model, "moe", None)
    return None if moe is None else moe.num_experts


SAVE_ATTENTION = ("qkv", "attn_out", "splash_residuals")
"""Activations that spare a remat'd layer its attention: the projections, the output and
the splash kernel's residuals (without splash, the attention backend recomputes)."""
REMAT_CANDIDATES = (
    ("remat", True, ()),
    ("offload", "offload", ()),
    ("no-remat", False, ()),
    ("remat save-attn", True, SAVE_ATTENTION),
    ("offload save-attn", "offload", SAVE_ATTENTION),
)
"""``(label, model.gradient_checkpointing, model.remat_save)`` of the remat policies a plan
tries: full remat, layer inputs offloaded to host, none, and each of the first two keeping
attention's inputs and results (``SAVE_ATTENTION``: attention is not recomputed)."""
SAVE_RING = ("ring_residuals",)
"""What spares a remat'd layer its ring attention (a split sequence): the ring's output and
log-sum-exp."""
RING_REMAT_CANDIDATES = (
    ("remat save-ring", True, SAVE_RING),
    ("offload save-ring", "offload", SAVE_RING),
)
"""The remat policies a plan also tries where the sequence is split (ring attention)."""


OFFLOAD_KEYS = (
    "trainer.offload_params",
    "trainer.offload_optimizer_state",
    "trainer.offload_optimizer_update",
)
"""The trainer keys that place state in host memory, in an order each step of
``apply_overrides`` validates when switching them on (no update on the host without the state)."""

OFFLOAD_CANDIDATES = (
    ("no-offload", (False, False, False)),
    ("offload-opt", (False, True, False)),
    ("offload-opt host-update", (False, True, True)),
    ("offload-all host-update", (True, True, True)),
)
"""``(label, values of OFFLOAD_KEYS)``: the optimizer state on the devices, in host memory
streamed to them for the update, or in host memory and updated there; and the stacked layers'
parameters in host memory too, each layer moved to the devices in the layer scan."""


def offload_variants(
    base: Candidate, config: TrainLmConfig, platform: str = "tpu"
) -> list[Candidate]:
    """``base`` with each other placement of the state (``OFFLOAD_CANDIDATES``); none for a
    DiLoCo run (which cannot offload), no parameter offload for unrolled layers, and no
    update on the host for GPUs (XLA's GPU compiler cannot build one: the run refuses it)."""
    if config.trainer.diloco is not None:
        return []
    over, trainer = base.overrides, config.trainer
    own = tuple(over.get(k, getattr(trainer, k.split(".", 1)[1])) for k in OFFLOAD_KEYS)
    scanned = over.get("model.scan_layers", config.model.scan_layers)
    out = []
    for name, values in OFFLOAD_CANDIDATES:
        if values == own or (values[0] and not scanned) or (values[2] and platform == "gpu"):
            continue
        keys = list(zip(OFFLOAD_KEYS, values, strict=True))
        rest = {k: v for k, v in over.items() if k not in OFFLOAD_KEYS}
        # switched on in dependency order, off in the reverse
        ordered = dict(keys if values[1] else keys[::-1])
        out.append(Candidate(f"{base.label} {name}", {**rest, **ordered}))
    return out


def remat_of(candidate: Candidate, config: TrainLmConfig) -> tuple:
    """``(gradient_checkpointing, remat_save)`` a candidate runs with."""
    over = candidate.overrides
    return (
        over.get("model.gradient_checkpointing", config.model.gradient_checkpointing),
        tuple(over.get("model.remat_save", config.model.remat_save)),
    )


def remat_variants(base: Candidate, config: TrainLmConfig, **_: object) -> list[Candidate]:
    """``base`` with each other remat policy of ``REMAT_CANDIDATES`` (and, where ``base``
    splits the sequence for ring attention, ``RING_REMAT_CANDIDATES``)."""
    own = remat_of(base, config)
    out = []
    context = base.overrides.get("trainer.mesh", {}).get("context", 1)
    policies = REMAT_CANDIDATES
    if context > 1 and config.model.context_parallel == "ring":
        policies += RING_REMAT_CANDIDATES
    for name, policy, save in policies:
        if (policy, save) != own:
            overrides = {
                **base.overrides,
                "model.gradient_checkpointing": policy,
                "model.remat_save": list(save),
            }
            out.append(Candidate(f"{base.label} {name}", overrides))
    return out


def microbatch_variants(base: Candidate, config: TrainLmConfig, **_: object) -> list[Candidate]:
    """``base`` with 2, 4 or 8 microbatches (``per_device_parallelism``) where the batch per
    device allows."""
    batch = config.trainer.batch_schedule.sizes[0]
    data_parallel = data_parallel_of(base)
    per_device = batch // data_parallel if batch % data_parallel == 0 else 0
    out = []
    for micro in (2, 4, 8):
        if per_device >= micro and per_device % micro == 0:
            overrides = {**base.overrides, "trainer.per_device_parallelism": per_device // micro}
            out.append(Candidate(f"{base.label} mb{micro}", overrides))
    return out


def data_parallel_of(candidate: Candidate) -> int:
    """replica x data x expert of a candidate's mesh (the devices its batch is split over)."""
    mesh = candidate.overrides["trainer.mesh"]
    return mesh["replica"] * mesh["data"] * mesh.get("expert", 1)


def run_default(config: TrainLmConfig, num_devices: int) -> Candidate:
    """The run's own strategy (its ``trainer.mesh`` and mappings, as written)."""
    sizes = config.trainer.mesh.resolve(num_devices)
    fsdp = config.trainer.fsdp_axis
    kind = ("fsdp" if config.trainer.shard_params else "zero2") if fsdp else "dp"
    tp = f" tp{sizes['model']}" if sizes["model"] > 1 else ""
    tp += f" cp{sizes['context']}" if sizes["context"] > 1 else ""
    tp += f" pp{sizes['stage']}" if sizes.get("stage", 1) > 1 else ""
    shape = f"{sizes['data']}x{sizes['model']}"
    if sizes["expert"] > 1:
        kind, shape = (
            f"{kind} ep{sizes['expert']}",
            f"{sizes['data']}x{sizes['expert']}x{sizes['model']}",
        )
    return Candidate(
        f"{kind}{tp} {shape} (the run's)",
        {
            "trainer.mesh": sizes,
            "trainer.fsdp_axis": fsdp,
            "trainer.shard_params": config.trainer.shard_params,
        },
    )


def nested(overrides: Overrides) -> dict[str, Any]:
    """``{"trainer.mesh": {...}}`` as ``{"trainer": {"mesh": {...}}}`` (for the YAML overlay)."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def as_flags(overrides: Overrides) -> list[str]:
    """The overrides as ``loomax train`` command-line flags."""
    flags = []
    for key, value in overrides.items():
        if isinstance(value, dict):
            flags += as_flags({f"{key}.{k}": v for k, v in value.items()})
        else:
            text = (
                "null"
                if value is None
                else str(value).lower()
                if isinstance(value, bool)
                else f"[{','.join(map(str, value))}]"
                if isinstance(value, list | tuple)
                else str(value)
            )
            flags += [f"--{key}", text]
    return flags
