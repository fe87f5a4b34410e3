"""The device mesh (``trainer.mesh``) and the two axis mappings that place named axes on it.

Mesh axes are ``replica`` (across slices or hosts), ``data`` and ``model``. The parameter
mapping says how parameters and optimizer state rest (FSDP: ``embed -> data``, tensor
parallel axes ``-> model``); the compute mapping says how activations are laid out
(``batch -> (replica, data)``, tensor-parallel axes ``-> model``). Layers never name mesh
axes: this module is the one place where logical names meet the mesh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import haliax as hax
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from loomax.config import ConfigError

MESH_AXES = ("replica", "data", "model")
DATA_AXES = ("replica", "data")

AxisResources = Mapping[str, str | Sequence[str] | None]


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; one of them may be -1 to take the remaining devices."""

    replica: int = 1
    """Copies of the data-parallel group, usually one per slice or host group."""
    data: int = -1
    """Data-parallel (and FSDP) size; -1 = the devices left over."""
    model: int = 1
    """Tensor-parallel size: the tensor_parallel_axes are split this many ways."""

    def __post_init__(self):
        sizes = self.as_dict()
        if list(sizes.values()).count(-1) > 1:
            raise ValueError(f"trainer.mesh: at most one axis may be -1, got {sizes}")
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ValueError(f"trainer.mesh.{name} must be positive or -1, got {size}")

    def as_dict(self) -> dict[str, int]:
        return {"replica": self.replica, "data": self.data, "model": self.model}

    def resolve(self, num_devices: int) -> dict[str, int]:
        """The axis sizes for ``num_devices`` devices, with -1 filled in."""
        sizes = self.as_dict()
        known = int(np.prod([s for s in sizes.values() if s != -1]))
        if -1 in sizes.values():
            if num_devices % known:
                raise ConfigError(
                    f"trainer.mesh {self.as_dict()}: the fixed axes ({known} devices) do not divide "
                    f"the {num_devices} devices"
                )
            sizes = {k: (num_devices // known if v == -1 else v) for k, v in sizes.items()}
        if int(np.prod(list(sizes.values()))) != num_devices:
            raise ConfigError(
                f"trainer.mesh {self.as_dict()} needs {int(np.prod(list(sizes.values())))} devices, "
                f"but there are {num_devices}"
            )
        return sizes

    def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """A ``Mesh`` with axes (replica, data, model) over ``devices`` (default: all).

        Devices are laid out process-major, so each process's devices hold a contiguous
        slice of the batch (what ``make_array_from_process_local_data`` expects).
        """
        devices = list(jax.devices() if devices is None else devices)
        sizes = self.resolve(len(devices))
        grid = np.array(devices, dtype=object).reshape([sizes[a] for a in MESH_AXES])
        return Mesh(grid, MESH_AXES)


@dataclass(frozen=True)
class AxisMappings:
    """The parameter and compute mappings, from logical axis names to mesh axes."""

    parameter: dict[str, str | tuple[str, ...]]
    compute: dict[str, str | tuple[str, ...]]


def make_axis_mappings(
    *,
    batch_axis: str = "batch",
    fsdp_axis: str | Sequence[str] | None = "embed",
    tensor_parallel_axes: Sequence[str] = ("mlp", "heads", "kv_heads"),
    axis_resources: AxisResources | None = None,
    parameter_axis_resources: AxisResources | None = None,
    compute_axis_resources: AxisResources | None = None,
) -> AxisMappings:
    """Build both mappings from the basic fields, then apply the advanced overrides.

    Raises ``ValueError`` when a logical axis is given two roles (e.g. both FSDP and
    tensor parallel) or one mapping sends two co-occurring roles to the same mesh axis.
    """
    fsdp = [fsdp_axis] if isinstance(fsdp_axis, str) else list(fsdp_axis or [])
    tp = list(tensor_parallel_axes)
    roles: dict[str, str] = {}
    for role, names in (
        ("batch_axis", [batch_axis]),
        ("fsdp_axis", fsdp),
        ("tensor_parallel_axes", tp),
    ):
        for name in names:
            if name in roles:
                raise ValueError(
                    f"trainer: axis {name!r} is mapped twice (in {roles[name]} and {role})"
                )
            roles[name] = role

    shared = {name: "model" for name in tp}
    parameter: dict = {**shared, **{name: "data" for name in fsdp}}
    compute: dict = {**shared, batch_axis: DATA_AXES}
    for overrides in (axis_resources, parameter_axis_resources):
        parameter.update(_clean(overrides))
    for overrides in (axis_resources, compute_axis_resources):
        compute.update(_clean(overrides))
    for label, mapping in (("parameter", parameter), ("compute", compute)):
        _check_mesh_axes(label, mapping)
    batch_mesh = set(_targets(compute.get(batch_axis)))
    for name, target in compute.items():
        clash = batch_mesh & set(_targets(target)) if name != batch_axis else set()
        if clash:
            raise ValueError(
                f"trainer compute mapping: {name!r} -> {target} reuses mesh axes {sorted(clash)} of the batch "
                f"axis {batch_axis!r}; activations carry both, so a mesh axis would be mapped twice"
            )
    return AxisMappings(
        parameter={k: v for k, v in parameter.items() if v},
        compute={k: v for k, v in compute.items() if v},
    )


def _clean(overrides: AxisResources | None) -> dict:
    out = {}
    for name, target in (overrides or {}).items():
        out[name] = tuple(target) if isinstance(target, list | tuple) else target
    return out


def _targets(target) -> tuple:
    if target is None:
        return ()
    return target if isinstance(target, tuple) else (target,)


def _check_mesh_axes(label: str, mapping: Mapping) -> None:
    for name, target in mapping.items():
        targets = _targets(target)
        for t in targets:
            if t is not None and t not in MESH_AXES:
                raise ValueError(
                    f"trainer {label} mapping: axis {name!r} -> unknown mesh axis {t!r} (mesh axes: {MESH_AXES})"
                )
        if len(set(targets)) != len(targets):
            raise ValueError(
                f"trainer {label} mapping: axis {name!r} uses a mesh axis twice: {targets}"
            )


def data_parallel_size(mesh: Mesh) -> int:
    """Devices the batch is split over: replica x data."""
    return int(np.prod([mesh.shape[a] for a in DATA_AXES]))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batches: leading axis over (replica, data), the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def replicate_indivisible(shardings: Any, tree: Any) -> tuple[Any, list[str]]:
    """``shardings`` with every array dimension that does not split evenly over its mesh axes
    kept whole, and a note per (logical axis, size, mesh axes) that fell back.

    A mapping names logical axes, not sizes, so e.g. ``kv_heads -> model`` is right for a
    grouped-query model with 8 KV heads on a model axis of 8 and impossible with 1 KV head:
    the axis is then replicated for that array instead of failing to place it.
    """
    notes: dict[str, None] = {}

    def fit(sharding, node):
        if not isinstance(sharding, NamedSharding):
            return sharding
        names = [a.name for a in node.axes] if isinstance(node, hax.NamedArray) else None
        shape = node.array.shape if isinstance(node, hax.NamedArray) else node.shape
        spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
        for i, entry in enumerate(spec):
            ways = int(np.prod([sharding.mesh.shape[a] for a in _targets(entry)]))
            if entry is not None and shape[i] % ways:
                label = repr(names[i]) if names else f"dimension {i}"
                notes[f"{label} (size {shape[i]}) does not split {ways} ways over {entry}"] = None
                spec[i] = None
        return NamedSharding(sharding.mesh, PartitionSpec(*spec))

    fitted = jax.tree.map(fit, shardings, tree, is_leaf=_is_sharding_or_none)
    return fitted, list(notes)


def _is_sharding_or_none(x: Any) -> bool:
    return x is None or isinstance(x, jax.sharding.Sharding)
