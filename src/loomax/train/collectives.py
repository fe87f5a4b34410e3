"""The collectives of a compiled program, read from its HLO text: which devices talk, and how much.

Used to check that a program keeps within groups of the mesh (DiLoCo's inner steps never
cross the ``replica`` axis) and to count the bytes a step sends (the DiLoCo bench note).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>"
    + "|".join(COLLECTIVES)
    + r")(?:-start)?\("
)
_ARRAY = re.compile(r"\b(pred|bf16|f16|f32|f64|[su](?:8|16|32|64))\[([\d,]*)\]")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)
_LISTED = re.compile(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")


@dataclass(frozen=True)
class Collective:
    """One collective op: its kind, the bytes of its result (per device) and its device groups."""

    op: str
    bytes: int
    groups: tuple[tuple[int, ...], ...]
    """Device groups by partition id (the position in ``mesh.devices.flat``); () = all devices."""
    line: str


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in ``hlo_text`` (``compiled.as_text()``); async pairs counted once."""
    found = []
    for line in hlo_text.splitlines():
        match = _OP.match(line)
        if not match:
            continue
        shape = match.group("shape")
        if "-start(" in line and shape.startswith("("):  # (operand, result) of an async start
            shape = shape[: len(shape) // 2 + 1]
        nbytes = sum(
            _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            for dtype, dims in _ARRAY.findall(shape)
        )
        found.append(Collective(match.group("op"), nbytes, _groups(line), line.strip()))
    return found


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    iota = _IOTA.search(line)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(p) for p in iota.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
    mesh = _MESH.search(line)
    if mesh:  # mesh['axis_0'=2,'axis_1'=4][, device_ids=([4,2]T(1,0))] {'axis_1'}
        axes = [a.split("=") for a in mesh.group(1).replace("'", "").split(",")]
        names, sizes = [a[0] for a in axes], [a[1] for a in axes]
        shape = [int(n) for n in sizes]
        ids = np.arange(int(np.prod(shape)))
        if mesh.group(2):
            ids = ids.reshape([int(d) for d in mesh.group(2).split(",")])
            if mesh.group(3):
                ids = ids.transpose([int(p) for p in mesh.group(3).split(",")])
        ids = ids.reshape(shape)
        grouped = [names.index(a.strip().strip("'")) for a in mesh.group(4).split(",") if a]
        rest = [i for i in range(len(names)) if i not in grouped]
        size = int(np.prod([shape[i] for i in grouped]))
        rows = ids.transpose(rest + grouped).reshape(-1, size)
        return tuple(tuple(int(i) for i in row) for row in rows)
    listed = _LISTED.search(line)
    if listed:
        return tuple(
            tuple(int(i) for i in group.split(",") if i)
            for group in re.findall(r"\{([\d,]*)\}", listed.group(1))
        )
    if "replica_groups=" in line and "replica_groups={}" not in line:
        raise ValueError(f"cannot read the replica groups of: {line.strip()[:300]}")
    return ()


def crosses(collective: Collective, mesh: Mesh, axis: str) -> bool:
    """Whether ``collective`` moves data between devices at different positions of mesh ``axis``."""
    coords = np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)
    along = coords[list(mesh.axis_names).index(axis)]
    groups = collective.groups or (tuple(range(mesh.devices.size)),)
    return any(len({int(along[i]) for i in group}) > 1 for group in groups)


def bytes_across(hlo_text: str, mesh: Mesh, axis: str) -> int:
    """Bytes (per device, summed over ops) of the collectives that cross mesh ``axis``."""
    return sum(c.bytes for c in collectives(hlo_text) if crosses(c, mesh, axis))
