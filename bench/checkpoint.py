"""Checkpoint save/restore throughput: Loomax's ``Checkpointer`` vs orbax-checkpoint.

Both libraries save and restore the same trainer-like state in the same process: a Loomax
GPT-2 (haliax NamedArrays) plus its ``optax.adamw`` state, float32, sized to at least
``--mb`` MB by the number of layers, sharded FSDP-style (``embed -> data``) over the devices.

    .venv/bin/python bench/checkpoint.py [--mb 600] [--rounds 3] [--devices 4] [--dir /tmp]

Each round saves and restores with Loomax, then with orbax (``StandardCheckpointer``,
its defaults), into a fresh temporary directory deleted afterwards. Per save it times the
stall (how long ``save`` blocks the caller: the copy to host and starting the background
write) and the total until the checkpoint is committed; per restore, the time until every
array is on its devices. Restored values and shardings are checked against the originals
(untimed). One untimed warm-up round comes first.

Reads most likely hit the page cache (the data was just written and the page cache cannot
be dropped without root), so restore figures are an upper bound for cold storage. Both
libraries write through tensorstore's file kvstore, which fsyncs every file by default.
MB = 1e6 bytes of array data (the global state, each replicated array counted once).

``--devices N`` sets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (and
``JAX_PLATFORMS=cpu`` if unset) before JAX is imported. Prints per-round figures, a table
of medians with the ratios loomax/orbax, and last one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LIBRARIES = ("loomax", "orbax")


@dataclass
class Timing:
    """One save/restore of one library; seconds."""

    stall_s: float
    save_s: float
    restore_s: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=600, help="minimum state size in MB (1e6 B)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of loomax then orbax")
    parser.add_argument("--devices", type=int, default=None, help="fake CPU devices (FSDP)")
    parser.add_argument("--dir", default=None, help="parent of the temporary directory")
    parser.add_argument("--hidden", type=int, default=768, help="GPT-2 hidden size")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    return parser.parse_args(argv)


def set_device_count(devices: int | None) -> None:
    """Ask XLA for ``devices`` host devices; must run before JAX is imported."""
    if devices is None:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ---------------------------------------------------------------------- the state
def gpt2_config(hidden: int, layers: int) -> Any:
    from loomax.models import Gpt2Config

    return Gpt2Config(hidden_dim=hidden, num_layers=layers, num_heads=max(1, hidden // 64))


def random_like(tree: Any, key: Any) -> Any:
    """Standard normal arrays shaped like the array leaves of ``tree``."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    )


def init_fn(hidden: int, layers: int, vocab: int) -> Callable[[Any], dict[str, Any]]:
    """A function of a PRNG key making ``{step, model, opt_state}`` as a trainer holds it.

    One AdamW step with random gradients is taken so the Adam moments are not all zeros
    (orbax compresses with zstd by default; zero moments would shrink its writes ~3x).
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    config = gpt2_config(hidden, layers)

    def init(key: Any) -> dict[str, Any]:
        model_key, grad_key = jax.random.split(key)
        model = config.build(vocab, key=model_key)
        params = eqx.filter(model, eqx.is_inexact_array)
        optimizer = optax.adamw(1e-3)
        grads = random_like(params, grad_key)
        updates, opt_state = optimizer.update(grads, optimizer.init(params), params)
        model = eqx.apply_updates(model, updates)
        return {"step": jnp.ones((), jnp.int32), "model": model, "opt_state": opt_state}

    return init


def nbytes(tree: Any) -> int:
    """Bytes of the array leaves of ``tree`` (arrays or shape structs)."""
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def layers_for(mb: float, hidden: int, vocab: int) -> int:
    """The fewest layers whose state is at least ``mb`` MB (the size is linear in layers)."""
    import jax

    key = jax.random.PRNGKey(0)
    one, two = (nbytes(jax.eval_shape(init_fn(hidden, n, vocab), key)) for n in (1, 2))
    return max(1, 1 + math.ceil((mb * 1e6 - one) / (two - one)))


def build_state(layers: int, hidden: int, vocab: int) -> Any:
    """The state, created directly in its FSDP sharding over all devices."""
    import haliax as hax
    import jax

    from loomax.mesh import MeshConfig, make_axis_mappings

    mesh = MeshConfig().build()
    init = init_fn(hidden, layers, vocab)
    key = jax.random.PRNGKey(0)
    shardings = hax.partitioning.infer_resource_partitions(
        jax.eval_shape(init, key),
        make_axis_mappings().parameter,
        preserve_existing_shardings=False,
        mesh=mesh,
    )
    with hax.partitioning.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)(key)
    return jax.block_until_ready(state)


def check_equal(restored: Any, original: Any, library: str) -> None:
    """Raise ``AssertionError`` unless ``restored`` has ``original``'s structure, values, shardings."""
    import jax
    import numpy as np

    paths, treedef = jax.tree_util.tree_flatten_with_path(original)
    leaves, restored_def = jax.tree.flatten(restored)
    if treedef != restored_def:
        raise AssertionError(f"{library}: restored tree structure differs")
    for (path, want), got in zip(paths, leaves, strict=True):
        name = jax.tree_util.keystr(path)
        if not np.array_equal(np.asarray(want), np.asarray(got)):
            raise AssertionError(f"{library}: {name} restored with different values")
        if isinstance(want, jax.Array) and not got.sharding.is_equivalent_to(
            want.sharding, want.ndim
        ):
            raise AssertionError(f"{library}: {name} restored with sharding {got.sharding}")


# ---------------------------------------------------------------------- the libraries
def abstract(state: Any) -> tuple[Any, Any]:
    """The restore target: shapes/dtypes (with shardings) and the shardings tree."""
    import jax

    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    return template, jax.tree.map(lambda x: x.sharding, state)


def run_loomax(state: Any, path: Path) -> tuple[Timing, Any]:
    """Save with ``block=False`` then wait; restore with ``load_checkpoint``."""
    import jax

    from loomax.checkpoint import (
        Checkpointer,
        CheckpointerConfig,
        list_checkpoints,
        load_checkpoint,
    )

    template, shardings = abstract(state)
    ckpt = Checkpointer(CheckpointerConfig(), str(path))
    start = time.perf_counter()
    ckpt.save(1, state, {}, permanent=True, block=False)
    stall = time.perf_counter() - start
    ckpt.wait()
    saved = time.perf_counter() - start
    start = time.perf_counter()
    restored, missing = load_checkpoint(list_checkpoints(str(path))[-1], template, shardings)
    jax.block_until_ready(restored)
    restore = time.perf_counter() - start
    if missing:
        raise AssertionError(f"loomax: missing {missing}")
    return Timing(stall, saved, restore), restored


def run_orbax(state: Any, path: Path) -> tuple[Timing, Any]:
    """``StandardCheckpointer`` (asynchronous) save then wait; restore to the abstract state."""
    import jax
    import orbax.checkpoint as ocp

    template, _ = abstract(state)
    target = path / "step-1"
    with ocp.StandardCheckpointer() as ckpt:
        start = time.perf_counter()
        ckpt.save(target, state)
        stall = time.perf_counter() - start
        ckpt.wait_until_finished()
        saved = time.perf_counter() - start
        start = time.perf_counter()
        restored = jax.block_until_ready(ckpt.restore(target, template))
        restore = time.perf_counter() - start
    return Timing(stall, saved, restore), restored


RUNNERS: dict[str, Callable[[Any, Path], tuple[Timing, Any]]] = {
    "loomax": run_loomax,
    "orbax": run_orbax,
}


def measure(library: str, state: Any, parent: Path) -> Timing:
    """One timed save + restore in a fresh directory, verified, then deleted."""
    path = Path(tempfile.mkdtemp(prefix=f"{library}-", dir=parent))
    try:
        timing, restored = RUNNERS[library](state, path)
        check_equal(restored, state, library)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    del restored
    gc.collect()  # free the restored copy before the next run
    return timing


def warm_up(state: Any, parent: Path) -> None:
    """An untimed save/restore of ``state`` per library (first-call paths, per-shape caches)."""
    for library in LIBRARIES:
        measure(library, state, parent)


# ---------------------------------------------------------------------- reporting
def summarize(timings: dict[str, list[Timing]], mb: float) -> dict[str, dict[str, float]]:
    """Per library: medians over rounds of MB/s and seconds."""
    out = {}
    for library, runs in timings.items():
        out[library] = {
            "save_mb_s": statistics.median(mb / t.save_s for t in runs),
            "save_s": statistics.median(t.save_s for t in runs),
            "stall_s": statistics.median(t.stall_s for t in runs),
            "restore_mb_s": statistics.median(mb / t.restore_s for t in runs),
            "restore_s": statistics.median(t.restore_s for t in runs),
        }
    return out


def print_table(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """Print the medians and the loomax/orbax ratios; return the ratios."""
    lo, ob = summary["loomax"], summary["orbax"]
    ratios = {
        "save_mb_s": lo["save_mb_s"] / ob["save_mb_s"],
        "stall_s": lo["stall_s"] / ob["stall_s"],
        "restore_mb_s": lo["restore_mb_s"] / ob["restore_mb_s"],
    }
    print(f"\n{'median':<14}{'save MB/s':>11}{'save s':>9}{'stall s':>9}{'restore MB/s':>14}")
    for library in LIBRARIES:
        s = summary[library]
        print(
            f"{library:<14}{s['save_mb_s']:>11.1f}{s['save_s']:>9.2f}"
            f"{s['stall_s']:>9.3f}{s['restore_mb_s']:>14.1f}"
        )
    print(
        f"{'loomax/orbax':<14}{ratios['save_mb_s']:>10.2f}x{'':>9}"
        f"{ratios['stall_s']:>8.2f}x{ratios['restore_mb_s']:>13.2f}x"
    )
    print("(MB/s: higher is better; stall: lower is better; restores likely hit the page cache)")
    return ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_device_count(args.devices)
    import jax
    import orbax.checkpoint as ocp

    logging.getLogger("absl").setLevel(logging.WARNING)
    layers = layers_for(args.mb, args.hidden, args.vocab)
    state = build_state(layers, args.hidden, args.vocab)
    mb = nbytes(state) / 1e6
    count = len(jax.tree.leaves(state))
    print(
        f"state: {mb:.1f} MB in {count} arrays (GPT-2 hidden {args.hidden}, {layers} layers, "
        f"vocab {args.vocab}, + AdamW state), {jax.device_count()} {jax.default_backend()} "
        f"device(s), orbax-checkpoint {ocp.__version__}, jax {jax.__version__}"
    )
    parent = Path(tempfile.mkdtemp(prefix="loomax-ckpt-bench-", dir=args.dir))
    timings: dict[str, list[Timing]] = {library: [] for library in LIBRARIES}
    try:
        warm_up(state, parent)
        for round_ in range(1, args.rounds + 1):
            for library in LIBRARIES:
                t = measure(library, state, parent)
                timings[library].append(t)
                print(
                    f"round {round_} {library:<7} save {t.save_s:6.2f} s ({mb / t.save_s:6.1f} MB/s,"
                    f" stall {t.stall_s:.3f} s)  restore {t.restore_s:6.2f} s "
                    f"({mb / t.restore_s:6.1f} MB/s)",
                    flush=True,
                )
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    summary = summarize(timings, mb)
    ratios = print_table(summary)
    result = {
        "state_mb": round(mb, 1),
        "arrays": count,
        "layers": layers,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "rounds": args.rounds,
        "orbax_version": ocp.__version__,
        **{lib: {k: round(v, 3) for k, v in s.items()} for lib, s in summary.items()},
        "loomax_over_orbax": {k: round(v, 3) for k, v in ratios.items()},
        "runs": {lib: [asdict(t) for t in runs] for lib, runs in timings.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
