"""The device mesh (``trainer.mesh``) and the axis mappings that place named axes on it.

Mesh axes are ``replica`` (across slices or hosts), ``data``, ``expert`` (a mixture of
experts' experts split over devices: expert parallelism), ``context`` (the sequence of every
batch row split over devices: context parallelism), ``model`` and ``stage`` (the stacked
layers split into consecutive stages: pipeline parallelism, ``layers -> stage``). The parameter mapping says
how parameters rest (FSDP: ``embed -> data``, ``experts -> expert``, tensor parallel axes
``-> model``); the optimizer mapping how optimizer state rests (as parameters, unless they
are kept whole: ZeRO-2); the compute mapping says how activations are laid out
(``batch -> (replica, data, expert)``: outside the experts the expert axis is one more
data-parallel axis; ``position -> context``; tensor-parallel axes ``-> model``). Layers
never name mesh axes: this module is the one place where logical names meet the mesh.

``current_mesh`` is the mesh in context (``jax.set_mesh``), also inside ``jit``, through
JAX's public API only. ``target_platform`` is the platform being compiled for: decided once,
where a step is built (``MeshRuntime.mesh_context`` enters ``compiling_for`` with its mesh's
platform), and read by the kernels that depend on it; model code never inspects devices.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import haliax as hax
import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from loomax.config import ConfigError
from loomax.row_blocks import row_blocks

logger = logging.getLogger(__name__)

MESH_AXES = ("replica", "data", "expert", "context", "model", "stage")
DATA_AXES = ("replica", "data", "expert")
EXPERT_AXIS = "expert"
"""The mesh axis a mixture of experts' ``experts`` are split over (and its tokens dispatched across)."""
CONTEXT_AXIS = "context"
"""The mesh axis the sequence (``position``) of activations is split over."""

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
    context: int = 1
    """Context-parallel size: each sequence (the `position` axis) is split this many ways (model.context_parallel picks how attention crosses the split)."""
    expert: int = 1
    """Expert-parallel size: MoE experts split this many ways, tokens sent to their experts' devices (a data-parallel axis elsewhere)."""
    stage: int = 1
    """Pipeline stages: the stacked layers split this many ways, a batch's microbatches passed from stage to stage (trainer.pipeline)."""
    auto: bool = False
    """Let `loomax train` choose the mesh and mappings at start: loomax plan's strategies, compiled for the devices present (the sizes above are then ignored)."""

    def __post_init__(self):
        sizes = self.as_dict()
        if list(sizes.values()).count(-1) > 1:
            raise ValueError(f"trainer.mesh: at most one axis may be -1, got {sizes}")
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ValueError(f"trainer.mesh.{name} must be positive or -1, got {size}")

    def as_dict(self) -> dict[str, int]:
        return {
            "replica": self.replica,
            "data": self.data,
            "expert": self.expert,
            "context": self.context,
            "model": self.model,
            "stage": self.stage,
        }

    def resolve(self, num_devices: int) -> dict[str, int]:
        """The axis sizes for ``num_devices`` devices, with -1 filled in."""
        if self.auto:
            raise ConfigError(
                "trainer.mesh.auto: the mesh is chosen by `loomax train` before the run starts "
                "(loomax.plan.auto.choose_strategy); a Trainer needs a concrete mesh"
            )
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
        """A ``Mesh`` with axes (replica, data, expert, context, model, stage) over ``devices`` (default: all),
        laid out by ``device_grid``."""
        devices = list(jax.devices() if devices is None else devices)
        sizes = self.resolve(len(devices))
        grid = device_grid([sizes[a] for a in MESH_AXES], devices)
        if jax.process_count() > 1:  # (devices of a topology, compiled on one host: any layout)
            row_blocks(grid)  # a ConfigError if the processes cannot split the rows
        return Mesh(grid, MESH_AXES)


def current_mesh() -> Mesh | AbstractMesh | None:
    """The mesh in context (``jax.set_mesh``, haliax's ``set_mesh``), None without one.

    Outside ``jit`` the device ``Mesh`` (``jax.sharding.get_mesh``); inside, its
    ``AbstractMesh`` (``jax.sharding.get_abstract_mesh``): JAX's public API gives no devices
    while tracing. Both have the axes' ``shape``, ``axis_names`` and ``size``, and either is
    ``jax.shard_map``'s ``mesh``.
    """
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return None
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside jit ("can only be used outside of `jax.jit`")
        return abstract
    return abstract if mesh.empty else mesh


_TARGET_PLATFORM = contextvars.ContextVar[str | None]("loomax_target_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Within it, ``target_platform()`` is ``platform`` (``tpu``, ``gpu``, ``cpu``): entered
    once where a step is built, with the platform of the devices it is compiled for."""
    if platform not in ("tpu", "gpu", "cpu"):
        raise ValueError(f"platform must be tpu, gpu or cpu, got {platform!r}")
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def target_platform() -> str:
    """The platform being compiled for: the one ``compiling_for`` set (the step builder's),
    else that of JAX's default devices (a model called outside any runtime)."""
    platform = _TARGET_PLATFORM.get()
    return platform if platform is not None else jax.default_backend()


def device_platform(mesh: Mesh) -> str:
    """The platform of ``mesh``'s devices (``cuda`` and ``rocm`` are ``gpu``)."""
    platform = mesh.devices.flat[0].platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def mapped_axes(
    mesh, logical: str, *sizes: int, keep_trivial: bool = False
) -> str | tuple[str, ...] | None:
    """The mesh axes the compute mapping in context sends ``logical`` to, as a
    ``PartitionSpec`` entry, where every one of ``sizes`` divides over them; else None
    (that dimension whole on every device). Axes of one device in all count as None too,
    unless ``keep_trivial`` (a ``shard_map`` that names every mesh axis it can needs no
    reduction over the others in its backward pass)."""
    mapping = hax.partitioning.current_thread_local_mapping() or {}
    target = mapping.get(logical)
    if target is None:
        return None
    names = (target,) if isinstance(target, str) else tuple(target)
    ways = math.prod(mesh.shape[n] for n in names)
    if (ways == 1 and not keep_trivial) or any(size % ways for size in sizes):
        return None
    return names[0] if len(names) == 1 else names


def context_spans_processes(grid: np.ndarray) -> bool:
    """Whether a ``context`` group of the (replica, data, expert, context, model) ``grid``
    holds devices of more than one process (they then load the same rows: ``row_blocks``)."""
    axis = MESH_AXES.index(CONTEXT_AXIS)
    groups = np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])
    return any(len({d.process_index for d in group}) > 1 for group in groups)


def device_grid(shape: Sequence[int], devices: Sequence[jax.Device]) -> np.ndarray:
    """``devices`` as a (replica, data, expert, context, model) array of ``shape``.

    TPU devices follow the physical topology (``mesh_utils``): over several slices,
    ``replica`` goes across slices (DCN) and every ``data`` x ``expert`` x ``context`` x ``model`` group stays within
    one (ICI); within a slice, groups follow the torus's links. Other devices (CPU, GPU) are
    laid out in order, process-major, so each process's devices hold a contiguous block of
    the batch (``row_blocks``; processes of a group spanning hosts share one); so are TPU
    devices of a multi-process run whose physical layout would not split the rows so.
    """
    in_order = np.array(devices, dtype=object).reshape(shape)
    if devices[0].platform != "tpu":
        return in_order
    from jax.experimental import mesh_utils

    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1 and shape[0] % slices:
        raise ConfigError(
            f"trainer.mesh.replica ({shape[0]}) must be a multiple of the {slices} slices, "
            "so that data, expert, context and model groups stay within a slice"
        )
    try:
        if slices > 1:
            ici, dcn = [shape[0] // slices, *shape[1:]], [slices] + [1] * (len(shape) - 1)
            grid = mesh_utils.create_hybrid_device_mesh(
                ici, dcn, devices, allow_split_physical_axes=True
            )
        else:
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError) as e:
        logger.warning("trainer.mesh %s: no physical layout (%s); devices in id order", shape, e)
        return in_order
    if jax.process_count() > 1 and not _rows_split_by_process(grid):
        return in_order
    return grid


def _rows_split_by_process(grid: np.ndarray) -> bool:
    """Whether the processes' devices in ``grid`` hold equal, disjoint or shared row blocks."""
    try:
        row_blocks(grid)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class AxisMappings:
    """The parameter, compute and optimizer-state mappings, from logical axis names to mesh axes."""

    parameter: dict[str, str | tuple[str, ...]]
    compute: dict[str, str | tuple[str, ...]]
    optimizer: dict[str, str | tuple[str, ...]] | None = None
    """Where optimizer state (and, inside the step, gradients) rests; None = as parameters."""

    def __post_init__(self):
        if self.optimizer is None:
            object.__setattr__(self, "optimizer", dict(self.parameter))

    @property
    def zero2(self) -> bool:
        """Optimizer state split where parameters are not (gradients reduce-scattered)."""
        return self.optimizer != self.parameter


def make_axis_mappings(
    *,
    batch_axis: str = "batch",
    fsdp_axis: str | Sequence[str] | None = "embed",
    tensor_parallel_axes: Sequence[str] = ("mlp", "heads", "kv_heads"),
    expert_axis: str | None = "experts",
    context_axis: str | None = "position",
    layer_axis: str | None = None,
    axis_resources: AxisResources | None = None,
    parameter_axis_resources: AxisResources | None = None,
    compute_axis_resources: AxisResources | None = None,
    shard_params: bool = True,
) -> AxisMappings:
    """Build the mappings from the basic fields, then apply the advanced overrides.

    ``shard_params=False`` keeps parameters whole on every device while the optimizer state
    (and the gradients, inside the step) are still split by ``fsdp_axis`` (ZeRO-2).
    ``expert_axis`` (a mixture of experts' experts) is split over the ``expert`` mesh axis in
    the parameter and optimizer mappings, as ``layer_axis`` (stacked layers) over ``stage``; ``context_axis`` (the sequence of activations) over
    the ``context`` mesh axis in the compute mapping (a mesh axis of size 1 splits nothing).

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
        ("expert_axis", [expert_axis] if expert_axis else []),
        ("context_axis", [context_axis] if context_axis else []),
        ("layer_axis", [layer_axis] if layer_axis else []),
    ):
        for name in names:
            if name in roles:
                raise ValueError(
                    f"trainer: axis {name!r} is mapped twice (in {roles[name]} and {role})"
                )
            roles[name] = role

    shared = {name: "model" for name in tp}
    optimizer: dict = {**shared, **{name: "data" for name in fsdp}}
    parameter: dict = dict(optimizer) if shard_params else dict(shared)
    if expert_axis:
        optimizer[expert_axis] = parameter[expert_axis] = EXPERT_AXIS
    if layer_axis:  # stacked layers rest on their stage (pipeline parallelism)
        optimizer[layer_axis] = parameter[layer_axis] = "stage"
    compute: dict = {**shared, batch_axis: DATA_AXES}
    if layer_axis:  # outside the staged stack (embedding, head, loss) stages split the batch
        compute[batch_axis] = (*DATA_AXES, "stage")
    if context_axis:
        compute[context_axis] = CONTEXT_AXIS
    for overrides in (axis_resources, parameter_axis_resources):
        parameter.update(_clean(overrides))
        optimizer.update(_clean(overrides))
    for overrides in (axis_resources, compute_axis_resources):
        compute.update(_clean(overrides))
    for label, mapping in (
        ("parameter", parameter),
        ("compute", compute),
        ("optimizer", optimizer),
    ):
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
        optimizer={k: v for k, v in optimizer.items() if v},
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
    """Devices the batch is split over: replica x data x expert."""
    return int(np.prod([mesh.shape[a] for a in DATA_AXES]))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batches: leading axis over (replica, data), the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
