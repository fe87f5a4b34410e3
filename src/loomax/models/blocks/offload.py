"""Layer parameters that rest in host memory (``trainer.offload_params``), fetched per layer.

The stacked blocks' arrays may live in pinned host memory. ``scan`` is ``haliax.scan`` for
such a stack: it runs ``jax.lax.scan`` over the raw arrays (``haliax.scan`` would index the
stack outside the loop to learn its structure, an operation on host memory that JAX
refuses) and moves each layer's slice to the devices (``fetch``) inside the loop body,
under the stack's remat policy, so the forward and the backward pass hold one layer's
weights at a time on the devices and the gradients go back to host memory (the transpose
of the move). A stack in device memory goes to ``haliax.scan`` unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import haliax as hax
import jax
from haliax import Axis, NamedArray
from jax.ad_checkpoint import checkpoint_name

_local = threading.local()
_named = lambda x: isinstance(x, NamedArray)  # noqa: E731


def on_host(x: Any) -> bool:
    """Whether ``x`` is an array (concrete or traced) resting in host memory."""
    return isinstance(x, jax.Array) and jax.typeof(x).memory_space == jax.memory.Space.Host


def any_on_host(tree: Any) -> bool:
    """Whether any array of ``tree`` rests in host memory."""
    return any(on_host(x) for x in jax.tree.leaves(tree))


@contextlib.contextmanager
def casting(cast: Callable[[Any], Any]) -> Iterator[None]:
    """While open (at trace time), ``fetch`` applies ``cast`` (e.g. the precision policy's
    ``cast_to_compute``) to what it brings to the devices: the train step casts the arrays
    in device memory itself and leaves the host-resident ones to be cast a layer at a time."""
    previous = getattr(_local, "cast", None)
    _local.cast = cast
    try:
        yield
    finally:
        _local.cast = previous


def fetch(tree: Any) -> Any:
    """``tree`` with its host-resident arrays moved to device memory (and cast, inside
    ``casting``); the other arrays are left as they are."""
    cast = getattr(_local, "cast", None) or (lambda x: x)
    device = jax.memory.Space.Device
    return jax.tree.map(lambda x: cast(jax.device_put(x, device)) if on_host(x) else x, tree)


def scan(
    fn: Callable[..., tuple[Any, Any]],
    axis: Axis,
    *,
    remat: Any = None,
    unroll: int | bool | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """``haliax.scan(fn, axis, remat=remat, unroll=unroll)`` that fetches host-resident
    scanned arguments one slice at a time (see the module docstring).

    Scanned are the ``NamedArray``s with ``axis`` (it must lead) and every other array,
    as in ``haliax.scan``; the rest is passed through. Outputs are stacked on ``axis``.
    A nested remat policy is applied per layer only (no outer blocks).
    """
    remat = False if remat is None else remat
    policy = hax.ScanCheckpointPolicy._mk(remat)
    steps = axis.size if unroll is True else 1 if unroll in (None, False) else int(unroll)
    carry_name = f"scan({axis.name})__carry"
    input_name = f"scan({axis.name})__input"

    def scanned(init: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not any_on_host((args, kwargs)):
            unroll_ = 1 if unroll is None else unroll
            return hax.scan(fn, axis, remat=remat, unroll=unroll_)(init, *args, **kwargs)
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_named)
        xs, layout = [], []  # layout: the slice's axes (named), True (raw array) or the leaf
        for leaf in leaves:
            if _named(leaf) and axis.name in {a.name for a in leaf.axes}:
                if leaf.axes[0].name != axis.name:
                    raise ValueError(f"offload.scan: {axis.name} must lead, got {leaf.axes}")
                xs.append(leaf.array)
                layout.append(leaf.axes[1:])
            elif isinstance(leaf, jax.Array) and not _named(leaf) and leaf.ndim:
                xs.append(leaf)
                layout.append(True)
            else:
                layout.append(leaf)
        out_layout: list[Any] = []

        def body(carry, x_leaves):
            carry = jax.tree.map(lambda a: checkpoint_name(a, carry_name), carry)
            x_leaves = jax.tree.map(lambda a: checkpoint_name(a, input_name), x_leaves)
            it = iter(fetch(list(x_leaves)))
            rebuilt = [
                NamedArray(next(it), kind) if isinstance(kind, tuple)
                else next(it) if kind is True else kind
                for kind in layout
            ]  # fmt: skip
            a, kw = jax.tree.unflatten(treedef, rebuilt)
            carry, y = fn(carry, *a, **kw)
            y_leaves, y_def = jax.tree.flatten(y, is_leaf=_named)
            out_layout[:] = [y_def, [x.axes if _named(x) else None for x in y_leaves]]
            return carry, [x.array if _named(x) else x for x in y_leaves]

        body = policy.checkpoint(carry_name, input_name, body)
        carry, ys = jax.lax.scan(body, init, xs, unroll=steps, length=axis.size)
        y_def, y_axes = out_layout
        stacked = [
            y if ax is None else NamedArray(y, (axis, *ax))
            for y, ax in zip(ys, y_axes, strict=True)
        ]
        return carry, jax.tree.unflatten(y_def, stacked)

    return scanned
