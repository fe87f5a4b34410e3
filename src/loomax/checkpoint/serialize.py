"""Pytrees <-> tensorstore: every array leaf is a zarr3 array, everything else JSON.

Layout of one saved tree under a directory: ``<leaf path>/zarr.json`` and its chunks
(``<leaf path>/c/i/j``), one chunk per shard (split further above ``MAX_CHUNK_BYTES``),
raw little-endian bytes followed by a crc32c checksum. Each process writes only the
shards it owns (``replica_id == 0``), so no chunk has two writers. The manifest
(shapes, dtypes, chunk shapes) and the non-array leaves are returned as JSON for the
caller's ``metadata.json``; nothing is pickled.

Saving is split in two so training can go on during the write: ``snapshot`` copies the
owned shards to host memory (fast, must happen before the arrays are donated), and
``write_snapshot`` writes them (slow, safe on a background thread). ``read_tree``
reads each device's slice for a target sharding, which reshards onto any mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import haliax as hax
import jax
import numpy as np
import tensorstore as ts

from loomax import tree_paths
from loomax.errors import UserError
from loomax.storage import CONTEXT, join
from loomax.tree_paths import is_named_array

MAX_CHUNK_BYTES = 64 * 1024 * 1024
"""Shards above this are split into several chunks, so large arrays are written in parallel."""

_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_JSON_SCALARS = (bool, int, float, str, type(None))


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be read: missing, truncated or of the wrong shape."""


@dataclass
class ArraySnapshot:
    """One array leaf's owned shards, copied to host memory."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    pieces: list[tuple[tuple[slice, ...], np.ndarray]] = field(default_factory=list)
    prng_impl: str | None = None

    def manifest(self) -> dict[str, Any]:
        entry = {"shape": list(self.shape), "dtype": self.dtype, "chunks": list(self.chunks)}
        if self.prng_impl is not None:
            entry["prng_impl"] = self.prng_impl
        return entry

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, p in self.pieces)


@dataclass
class Snapshot:
    """A pytree's owned array shards on the host, plus its JSON leaves and manifest."""

    arrays: list[ArraySnapshot]
    values: dict[str, Any]

    def manifest(self) -> dict[str, Any]:
        return {a.name: a.manifest() for a in self.arrays}

    @property
    def nbytes(self) -> int:
        """Bytes this process will write."""
        return sum(a.nbytes for a in self.arrays)


# ---------------------------------------------------------------------- naming


def _unname(x: Any) -> Any:
    return x.array if is_named_array(x) else x


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf of ``tree``, in flattening order.

    Names are slash-separated key paths (``model/blocks/attn/q/weight``, ``root`` for a bare
    leaf); a Haliax ``NamedArray`` counts as one leaf (its array), named by its own path.
    """
    named = [(name or "root", _unname(leaf)) for name, leaf in tree_paths.named_leaves(tree)]
    seen: set[str] = set()
    for name, _ in named:
        if name in seen:
            raise ValueError(f"two pytree leaves share the checkpoint name {name!r}")
        seen.add(name)
    return named


# ---------------------------------------------------------------------- save
def _chunk_shape(shard_shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    chunks = list(shard_shape)
    while math.prod(chunks) * itemsize > MAX_CHUNK_BYTES:
        # halve the outermost splittable dim: chunks stay contiguous runs of rows
        even = [i for i, c in enumerate(chunks) if c % 2 == 0]
        if not even:
            break
        chunks[even[0]] //= 2
    return tuple(max(c, 1) for c in chunks)


def _is_prng_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def snapshot(tree: Any) -> Snapshot:
    """Copy the shards of ``tree`` this process owns to host memory; JSON leaves as values.

    Raises ``TypeError`` for a leaf that is neither an array nor a JSON scalar.
    """
    arrays: list[ArraySnapshot] = []
    values: dict[str, Any] = {}
    pending: list[tuple[ArraySnapshot, list[tuple[tuple[slice, ...], jax.Array]]]] = []
    for name, leaf in named_leaves(tree):
        if isinstance(leaf, jax.Array):
            impl = None
            if _is_prng_key(leaf):
                impl = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            shard_shape = leaf.sharding.shard_shape(leaf.shape)
            snap = ArraySnapshot(
                name,
                tuple(leaf.shape),
                leaf.dtype.name,
                _chunk_shape(shard_shape, leaf.dtype.itemsize),
                prng_impl=impl,
            )
            owned = [(s.index, s.data) for s in leaf.addressable_shards if s.replica_id == 0]
            for _, data in owned:
                data.copy_to_host_async()
            pending.append((snap, owned))
            arrays.append(snap)
        elif isinstance(leaf, np.ndarray | np.generic):
            snap = ArraySnapshot(
                name,
                tuple(np.shape(leaf)),
                leaf.dtype.name,
                _chunk_shape(np.shape(leaf), leaf.dtype.itemsize),
            )
            if jax.process_index() == 0:
                snap.pieces.append((tuple(slice(None) for _ in snap.shape), np.array(leaf)))
            arrays.append(snap)
        elif isinstance(leaf, _JSON_SCALARS):
            values[name] = leaf
        else:
            raise TypeError(
                f"cannot checkpoint leaf {name!r} of type {type(leaf).__name__}: only arrays and "
                "JSON scalars are saved (no pickle)"
            )
    for snap, owned in pending:  # copies were started above; now collect them
        # np.asarray: one device-to-host copy on accelerators; on CPU a view that keeps the
        # buffer alive (jax then does not reuse a donated buffer someone still references)
        snap.pieces = [(index, np.asarray(data)) for index, data in owned]
    return Snapshot(arrays, values)


def _spec(url: str, entry: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": url + "/",
        "store_data_equal_to_fill_value": True,  # every chunk exists, so a lost one is detectable
    }
    if entry is not None:
        spec["metadata"] = {
            "shape": entry["shape"],
            "data_type": entry["dtype"],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": entry["chunks"]}},
            "codecs": _CODECS,
        }
    return spec


def write_snapshot(snap: Snapshot, url: str, *, create_metadata: bool) -> None:
    """Write ``snap``'s pieces under ``url``; ``create_metadata`` on exactly one process.

    The other processes open the arrays assuming the metadata, so no process waits for
    another before writing its own chunks.
    """
    opens = []
    for array in snap.arrays:
        spec = _spec(join(url, array.name), array.manifest())
        if create_metadata:
            opens.append(ts.open(spec, create=True, open=True, context=CONTEXT))
        elif array.pieces:
            opens.append(ts.open(spec, open=True, assume_metadata=True, context=CONTEXT))
        else:
            opens.append(None)
    writes = []
    for array, opening in zip(snap.arrays, opens, strict=True):
        if opening is None:
            continue
        store = opening.result()
        for index, data in array.pieces:
            # the snapshot is never modified, so tensorstore may use it without a copy
            writes.append(store[index].write(data, can_reference_source_data_indefinitely=True))
    for w in writes:
        w.result()


# ---------------------------------------------------------------------- load
def _expected_chunks(entry: dict[str, Any]) -> int:
    return math.prod(math.ceil(s / c) for s, c in zip(entry["shape"], entry["chunks"], strict=True))


def check_chunks(url: str, keys: Sequence[str], manifest: dict[str, Any]) -> None:
    """Raise ``CheckpointError`` naming the first array with missing metadata or chunks.

    ``keys`` are the keys under the checkpoint directory (one listing for all arrays).
    """
    found: dict[str, int] = {}
    meta: set[str] = set()
    for key in keys:
        if key.endswith("/zarr.json"):
            meta.add(key[: -len("/zarr.json")])
        elif "/c/" in key or key.endswith("/c"):
            name = key[: key.rindex("/c/")] if "/c/" in key else key[:-2]
            found[name] = found.get(name, 0) + 1
    for name, entry in manifest.items():
        if name not in meta:
            raise CheckpointError(f"array {name!r}: its zarr.json is missing")
        expected = _expected_chunks(entry)
        if found.get(name, 0) < expected:
            raise CheckpointError(
                f"array {name!r}: {expected - found.get(name, 0)} of {expected} chunks are missing"
            )


def read_tree(
    url: str,
    manifest: dict[str, Any],
    values: dict[str, Any],
    template: Any,
    shardings: Any,
    *,
    names: set[str] | None = None,
) -> tuple[Any, list[str]]:
    """Read the leaves of ``template`` (shapes/dtypes) placed by ``shardings`` from ``url``.

    Only leaves whose names are in ``names`` (default: all) are read; the others, and
    leaves absent from the checkpoint, come back as None and are listed as missing.
    Arrays are read per device for the target sharding, so any mesh can load any
    checkpoint. A dtype differing from the checkpoint's is cast; a shape mismatch raises.
    """
    named = named_leaves(template)
    template_leaves, treedef = jax.tree.flatten(template, is_leaf=is_named_array)
    shard_leaves = [_unname(s) for s in treedef.flatten_up_to(shardings)]
    missing: list[str] = []
    jobs = []
    for (name, leaf), sharding in zip(named, shard_leaves, strict=True):
        if names is not None and name not in names:
            jobs.append(None)
            continue
        if name in values:
            jobs.append(("value", values[name]))
            continue
        entry = manifest.get(name)
        if entry is None:
            missing.append(name)
            jobs.append(None)
            continue
        jobs.append(("array", _start_read(url, name, entry, leaf, sharding)))
    out = []
    for (name, _), job, original in zip(named, jobs, template_leaves, strict=True):
        if job is None:
            out.append(None)
        elif job[0] == "value":  # a NamedArray with no array (a frozen slot) stays one
            empty = is_named_array(original) and original.array is None
            out.append(original if job[1] is None and empty else job[1])
        else:
            array = _finish_read(url, name, *job[1])
            out.append(hax.NamedArray(array, original.axes) if is_named_array(original) else array)
    return jax.tree.unflatten(treedef, out), missing


def _start_read(url: str, name: str, entry: dict[str, Any], leaf: Any, sharding):
    shape = tuple(entry["shape"])
    prng = _is_prng_key(leaf)
    data = jax.eval_shape(jax.random.key_data, leaf) if prng else leaf
    if shape != tuple(data.shape):
        raise CheckpointError(
            f"array {name!r} has shape {shape} in the checkpoint but {tuple(data.shape)} in the model"
        )
    try:
        store = ts.open(_spec(join(url, name)), open=True, context=CONTEXT).result()
    except ValueError as e:
        raise CheckpointError(f"array {name!r}: cannot open ({e})") from e
    if prng and isinstance(
        sharding, jax.sharding.NamedSharding
    ):  # key data has extra trailing dims
        extra = (None,) * (len(data.shape) - len(leaf.shape))
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, *extra)
        )
    index_map = sharding.addressable_devices_indices_map(shape)
    reads: dict[Any, Any] = {}
    for index in index_map.values():
        key = _index_key(index)
        if key not in reads:
            reads[key] = store[index].read()
    return data.dtype, prng, sharding, shape, index_map, reads, entry


def _finish_read(url, name, dtype, prng, sharding, shape, index_map, reads, entry):
    try:
        host = {key: future.result() for key, future in reads.items()}
    except ValueError as e:
        raise CheckpointError(f"array {name!r}: {e}") from e
    pieces = [
        jax.device_put(np.asarray(host[_index_key(index)], dtype=dtype), device)
        for device, index in index_map.items()
    ]
    array = jax.make_array_from_single_device_arrays(shape, sharding, pieces)
    if prng:
        array = jax.random.wrap_key_data(array, impl=entry.get("prng_impl"))
    return array


def _index_key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)
