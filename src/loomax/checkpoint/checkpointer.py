"""Checkpoint policies, asynchronous atomic saves, discovery and loading.

A checkpoint is ``<base_path>/step-<N>/``: the arrays (see ``serialize``) are written
first and ``metadata.json`` last, so a directory without it is incomplete and ignored.
Temporary checkpoints (every ``save_interval`` of wall time or ``save_interval_steps``
steps) are deleted once a newer checkpoint commits; permanent ones (the ``keep`` step
policies, ``fixed_steps``, the start and the end of training) stay, as ``removal`` and
``keep_last`` say. A save that fails stops the run with ``CheckpointSaveError`` on every
process; the checkpoints already complete are untouched.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import jax

from loomax.checkpoint.serialize import (
    CheckpointError,
    check_chunks,
    read_tree,
    snapshot,
    write_snapshot,
)
from loomax.config import ConfigError
from loomax.distributed import barrier, coordination_client
from loomax.errors import UserError
from loomax.storage import Directory, to_url

logger = logging.getLogger(__name__)

METADATA = "metadata.json"
FORMAT = "loomax-checkpoint/1"
_STEP_DIR = re.compile(r"step-(\d+)")
_VERSIONED = ("loomax", "jax", "jaxlib", "haliax", "equinox", "optax", "tensorstore", "numpy")
REMOVAL_STRATEGIES = ("ephemeral_only", "all_non_permanent", "never")


class CheckpointSaveError(UserError, OSError):
    """A checkpoint could not be written (full disk, no permission, a store refusing it).

    The run stops; the checkpoints already complete stay loadable and the next start
    resumes from the newest of them.
    """


@dataclass(frozen=True)
class KeepPolicy:
    """Keep a permanent checkpoint every ``every`` steps, up to step ``until``."""

    every: int = 10000
    """Save a permanent checkpoint at steps divisible by this."""
    until: int | None = None
    """Last step this policy applies to; null = to the end of training."""


@dataclass(frozen=True)
class CheckpointerConfig:
    """The ``trainer.checkpointer`` section: where checkpoints go and when they are saved."""

    base_path: str | None = None
    """Directory or URL (gs://, s3://, anything tensorstore supports) of the checkpoints; null = <run_dir>/checkpoints."""
    save_interval: timedelta | None = timedelta(minutes=15)
    """Wall time between temporary checkpoints (deleted once a newer one commits), e.g. 15m; null = none."""
    keep: list[KeepPolicy] = field(default_factory=lambda: [KeepPolicy(10000)])
    """Permanent checkpoints: a list of {every: N, until: M} step policies, in increasing `until`."""
    delete_old_temp_checkpoints: bool = True
    """Also delete temporary checkpoints left by an earlier attempt of this run once a newer one commits."""
    save_at_end: bool = True
    """Save a permanent checkpoint when training ends (and a temporary one when it is stopped early)."""
    save_interval_steps: int | None = None
    """Also a temporary checkpoint every this many steps; null = none."""
    temporary_cooldown: timedelta | None = None
    """Least wall time between a save and the next temporary one (a temporary save due sooner is skipped); null = none."""
    fixed_steps: list[int] = field(default_factory=list)
    """Steps that get a permanent checkpoint whatever the other policies say; never deleted."""
    save_at_start: bool = False
    """Save a permanent checkpoint of the initial state (step 0) before the first step of a fresh run; never deleted."""
    keep_last: int | None = None
    """Keep only the newest N checkpoints of those `removal` may delete; null = temporary ones go once superseded."""
    removal: str = "ephemeral_only"
    """What may be deleted: ephemeral_only (temporary checkpoints), all_non_permanent (also keep-policy and end-of-training ones beyond keep_last), never."""
    async_save: bool = True
    """Write checkpoints on a background thread while training goes on; false = each save blocks until committed."""
    append_run_id_to_base_path: bool = False
    """Save under <base_path>/<run_id>, so runs that share a base_path never see each other's checkpoints."""

    def __post_init__(self):
        where = "trainer.checkpointer"
        if self.save_interval_steps is not None and self.save_interval_steps <= 0:
            raise ValueError(
                f"{where}.save_interval_steps must be > 0 or null, got {self.save_interval_steps}"
            )
        if self.temporary_cooldown is not None and self.temporary_cooldown.total_seconds() <= 0:
            raise ValueError(
                f"{where}.temporary_cooldown must be positive or null, got {self.temporary_cooldown}"
            )
        bad = [s for s in self.fixed_steps if s < 0]
        if bad:
            raise ValueError(f"{where}.fixed_steps must be steps >= 0, got {bad}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"{where}.keep_last must be >= 1 or null, got {self.keep_last}")
        if self.removal not in REMOVAL_STRATEGIES:
            raise ValueError(
                f"{where}.removal must be one of {list(REMOVAL_STRATEGIES)}, got {self.removal!r}"
            )
        if self.removal == "all_non_permanent" and self.keep_last is None:
            raise ValueError(
                f"{where}.removal all_non_permanent needs keep_last (how many checkpoints to keep)"
            )
        previous: int | None = -1
        for i, policy in enumerate(self.keep):
            where = f"trainer.checkpointer.keep[{i}]"
            if policy.every <= 0:
                raise ValueError(f"{where}.every must be > 0, got {policy.every}")
            if previous is None:
                raise ValueError(f"{where}: only the last keep policy may have until: null")
            if policy.until is not None and policy.until <= previous:
                raise ValueError(
                    f"{where}.until ({policy.until}) must be larger than the previous policy's until ({previous})"
                )
            previous = policy.until
        if self.save_interval is not None and self.save_interval.total_seconds() <= 0:
            raise ValueError(
                f"trainer.checkpointer.save_interval must be positive or null, got {self.save_interval}"
            )

    def is_pinned(self, step: int) -> bool:
        """Whether ``step`` is one of ``fixed_steps``: its checkpoint is never deleted."""
        return step in self.fixed_steps

    def is_permanent(self, step: int) -> bool:
        """Whether ``fixed_steps`` or the keep policies ask for a permanent checkpoint at ``step``."""
        if self.is_pinned(step):
            return True
        for policy in self.keep:
            if policy.until is None or step <= policy.until:
                return step % policy.every == 0
        return False


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint found on storage."""

    step: int
    directory: Directory
    metadata: dict[str, Any]

    @property
    def permanent(self) -> bool:
        return bool(self.metadata.get("permanent", True))

    @property
    def pinned(self) -> bool:
        """Saved at one of ``fixed_steps`` or before the first step: never deleted."""
        return bool(self.metadata.get("pinned", False))

    @property
    def run_id(self) -> str | None:
        """The run that saved it (None for checkpoints older than the record)."""
        return self.metadata.get("run_id")

    def __str__(self) -> str:
        return str(self.directory)


def list_checkpoints(path: str) -> list[CheckpointInfo]:
    """Complete checkpoints at ``path``, oldest first.

    ``path`` is one checkpoint (it has ``metadata.json``) or a directory of ``step-N``
    checkpoints; directories without ``metadata.json`` are skipped.
    """
    root = Directory(to_url(path))
    meta = root.read_json(METADATA)
    if meta is not None:
        return [CheckpointInfo(int(meta["step"]), root, meta)]
    found = []
    for name in root.subdirectories():
        if not _STEP_DIR.fullmatch(name):
            continue
        directory = root.child(name)
        meta = directory.read_json(METADATA)
        if meta is None:
            logger.info("ignoring incomplete checkpoint %s (no %s)", directory, METADATA)
            continue
        found.append(CheckpointInfo(int(meta["step"]), directory, meta))
    return sorted(found, key=lambda c: c.step)


def load_checkpoint(
    checkpoint: CheckpointInfo, template: Any, shardings: Any, *, prefix: str | None = None
) -> tuple[Any, list[str]]:
    """Read ``template``'s leaves from ``checkpoint``; returns ``(tree, missing names)``.

    ``prefix`` reads only leaves under it (e.g. ``model``), the rest come back as None.
    Errors name the checkpoint and the array.
    """
    meta = checkpoint.metadata
    arrays = meta.get("arrays", {})
    values = meta.get("values", {})
    names = None
    if prefix is not None:
        names = {
            n for n in list(arrays) + list(values) if n == prefix or n.startswith(prefix + "/")
        }
        arrays = {n: e for n, e in arrays.items() if n in names}
    try:
        check_chunks(checkpoint.directory.url, checkpoint.directory.keys(), arrays)
        tree, missing = read_tree(
            checkpoint.directory.url, arrays, values, template, shardings, names=names
        )
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {checkpoint}: {e}") from e
    if prefix is not None:
        missing = [n for n in missing if n == prefix or n.startswith(prefix + "/")]
    return tree, missing


def load_latest(
    path: str,
    template: Any,
    shardings: Any,
    *,
    fall_back: bool,
    prefix: str | None = None,
) -> tuple[CheckpointInfo, Any, list[str]] | None:
    """Load the newest complete checkpoint at ``path``; None if there is none.

    With ``fall_back``, a checkpoint that fails to load is skipped with a warning and
    the next older one is tried; otherwise its error is raised.
    """
    for checkpoint in reversed(list_checkpoints(path)):
        try:
            tree, missing = load_checkpoint(checkpoint, template, shardings, prefix=prefix)
        except CheckpointError as e:
            if not fall_back:
                raise
            logger.warning("%s; falling back to an older checkpoint", e)
            continue
        return checkpoint, tree, missing
    return None


def library_versions() -> dict[str, str]:
    """Versions of the libraries a checkpoint depends on."""
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


class Checkpointer:
    """Saves checkpoints of a pytree under ``base_path`` by the config's policies.

    ``save`` copies the owned shards to the host at once, then writes on a background
    thread while training goes on; at most one save is in flight (a new save, and
    ``wait``, block on the previous one). An error in the background is raised by the
    next ``save`` or ``wait``.
    """

    def __init__(
        self,
        config: CheckpointerConfig,
        base_path: str,
        *,
        run_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.run_id = run_id
        if config.append_run_id_to_base_path:
            if run_id is None:
                raise ConfigError("trainer.checkpointer.append_run_id_to_base_path needs a run id")
            base_path = base_path.rstrip("/") + "/" + run_id
        self.directory = Directory(to_url(base_path))
        self._clock = clock
        self._last_save_time = clock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._temporary: list[CheckpointInfo] = []
        self._regular: list[
            CheckpointInfo
        ] = []  # permanent but not pinned: all_non_permanent prunes them
        self._saves = 0
        self.last_saved_step: int | None = None
        self.last_save_bytes = 0
        """Bytes this process wrote in the latest save."""

    def check_writable(self) -> None:
        """Raise ``ConfigError`` naming ``base_path`` if it cannot be written (process 0 checks)."""
        if jax.process_index() == 0:
            try:
                self.directory.check_writable()
            except OSError as e:
                raise ConfigError(f"trainer.checkpointer.base_path: {e}") from e

    def adopt(self, checkpoints: list[CheckpointInfo], resumed_step: int | None) -> None:
        """Take note of existing checkpoints: old temporary ones are deleted on the next commit."""
        if resumed_step is not None:
            self.last_saved_step = resumed_step
        if self.config.delete_old_temp_checkpoints:
            self._temporary.extend(c for c in checkpoints if not c.permanent)
        self._regular.extend(c for c in checkpoints if c.permanent and not c.pinned)

    def due(self, step: int) -> str | None:
        """``"permanent"``, ``"temporary"`` or None: whether to save at ``step`` now."""
        if step == self.last_saved_step:
            return None
        if self.config.is_permanent(step):
            return "permanent"
        since_last = self._clock() - self._last_save_time
        interval, every = self.config.save_interval, self.config.save_interval_steps
        by_time = interval is not None and since_last >= interval.total_seconds()
        by_steps = every is not None and step % every == 0
        if not (by_time or by_steps):
            return None
        cooldown = self.config.temporary_cooldown
        if cooldown is not None and since_last < cooldown.total_seconds():
            logger.debug("temporary checkpoint at step %d skipped: within the cooldown", step)
            return None
        return "temporary"

    def raise_if_failed(self) -> None:
        """Raise the error of a save that already failed in the background (never blocks)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def save(
        self,
        step: int,
        tree: Any,
        metadata: dict[str, Any],
        *,
        permanent: bool,
        pinned: bool = False,
        block: bool = False,
        files: dict[str, bytes] | None = None,
    ) -> bool:
        """Save ``tree`` as ``step-<step>`` (returns False if that step was just saved).

        Every process must call this with the same step. ``metadata`` (JSON) is merged
        into ``metadata.json``; ``files`` (name -> bytes) are written by process 0 into the
        checkpoint directory before the commit. ``pinned`` (or a step of ``fixed_steps``)
        marks a checkpoint no removal strategy deletes. ``block`` (or ``async_save: false``)
        returns once it has committed.
        """
        self.wait()
        if step == self.last_saved_step:
            return False
        self._last_save_time = self._clock()
        started = time.perf_counter()
        jax.block_until_ready(tree)  # the step that produced it
        ready = time.perf_counter()
        snap = snapshot(tree)
        self.last_save_bytes = snap.nbytes
        self.last_saved_step = step
        self._saves += 1
        meta = {
            **metadata,
            "format": FORMAT,
            "step": step,
            "permanent": permanent,
            "pinned": pinned or self.config.is_pinned(step),
            "run_id": self.run_id,
            "saved_at": datetime.now(UTC).isoformat(),
            "timestamp": time.time(),
            "process_count": jax.process_count(),
            "versions": library_versions(),
            "arrays": snap.manifest(),
            "values": snap.values,
        }
        target = self.directory.child(f"step-{step}")
        tag = f"loomax_checkpoint_{self._saves}_{step}"
        logger.info(
            "checkpoint step %d: state ready after %.2fs, %.1f MB copied to host in %.2fs; writing %s",
            step,
            ready - started,
            snap.nbytes / 1e6,
            time.perf_counter() - ready,
            target,
        )

        def write():
            try:
                self._write(target, snap, meta, tag, files or {})
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                self._error = e

        self._thread = threading.Thread(target=write, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        if block or not self.config.async_save:
            self.wait()
        return True

    def _write(
        self, target: Directory, snap, meta: dict[str, Any], tag: str, files: dict[str, bytes]
    ) -> None:
        started = time.perf_counter()
        primary = jax.process_index() == 0
        error: BaseException | None = None
        try:
            if primary and target.keys():  # an incomplete attempt at this step (a crash mid-save)
                target.delete(first=METADATA)
        except Exception as e:  # noqa: BLE001 - reported with the others below
            error = e
        barrier(tag + "_start")
        if error is None:
            try:
                write_snapshot(snap, target.url, create_metadata=primary)
            except Exception as e:  # noqa: BLE001
                error = e
        # every process reaches the barrier, failed or not, so none waits out its timeout
        failed = _agree_on_failure(tag, error)
        if error is None and primary and not failed:
            try:
                for name, data in files.items():
                    target.write_bytes(name, data)
                target.write_json(METADATA, meta)  # the commit
            except Exception as e:  # noqa: BLE001
                error = e
        if error is not None or failed:
            cause = f"{type(error).__name__}: {error}" if error else f"process(es) {failed} failed"
            raise CheckpointSaveError(
                f"checkpoint step {meta['step']} could not be written to {target} ({cause}); "
                f"the run stops here. Complete checkpoints are untouched: "
                f"{_newest_complete(self.directory)}"
            ) from error
        if primary:
            logger.info(
                "checkpoint step %d committed (%s) in %.2fs",
                meta["step"],
                "permanent" if meta["permanent"] else "temporary",
                time.perf_counter() - started,
            )
            info = CheckpointInfo(meta["step"], target, meta)
            if not meta["permanent"]:
                self._temporary.append(info)
            elif not meta["pinned"]:
                self._regular.append(info)
            self._remove_old(meta["step"])

    def _remove_old(self, step: int) -> None:
        """Delete what ``removal`` and ``keep_last`` let go, now that ``step`` has committed."""
        config = self.config
        if config.removal == "never":
            return
        temporary = sorted(self._temporary, key=lambda c: c.step, reverse=True)
        if config.keep_last is None:  # superseded ones go
            kept = [c for c in temporary if c.step >= step]
        else:
            kept = temporary[: config.keep_last]
        self._delete([c for c in temporary if all(c is not k for k in kept)], "temporary")
        self._temporary = kept
        if config.removal == "all_non_permanent":
            regular = sorted(self._regular, key=lambda c: c.step, reverse=True)
            self._delete(regular[config.keep_last :], "permanent (removal all_non_permanent)")
            self._regular = regular[: config.keep_last]

    @staticmethod
    def _delete(checkpoints: list[CheckpointInfo], kind: str) -> None:
        for old in checkpoints:
            logger.info("deleting %s checkpoint %s", kind, old)
            old.directory.delete(first=METADATA)

    def wait(self) -> None:
        """Block until the save in flight (if any) has committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _agree_on_failure(tag: str, error: BaseException | None) -> list[int]:
    """Tell the other processes whether this one's write failed; returns the processes that did.

    Every process calls it (after its write, failed or not) and waits for the others, so a
    failure on one host stops the save everywhere instead of leaving the others at a barrier.
    """
    client = coordination_client()
    if client is None:
        return [0] if error is not None else []
    if error is not None:
        client.key_value_set(f"{tag}/failed/{jax.process_index()}", f"{type(error).__name__}")
    barrier(tag + "_written")
    return sorted(
        int(key.rsplit("/", 1)[-1]) for key, _ in client.key_value_dir_get(f"{tag}/failed/")
    )


def _newest_complete(directory: Directory) -> str:
    """Where the next start resumes from: the newest complete checkpoint under ``directory``."""
    try:
        found = list_checkpoints(directory.url)
    except Exception as e:  # noqa: BLE001 - the store may be what failed
        return f"(could not list them: {e})"
    if not found:
        return "there are none yet, so the next start begins afresh"
    return f"the next start resumes from the newest, step {found[-1].step} ({found[-1].directory})"
