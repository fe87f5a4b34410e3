"""Saving checkpoints: asynchronous, atomic, by the policies of ``policy``.

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
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import jax

from loomax.checkpoint.discovery import METADATA, CheckpointInfo, list_checkpoints
from loomax.checkpoint.policy import CheckpointerConfig
from loomax.checkpoint.serialize import snapshot, write_snapshot
from loomax.config import ConfigError
from loomax.distributed import barrier, coordination_client
from loomax.errors import UserError
from loomax.jax_setup import process_index_before_backend
from loomax.storage import Directory, to_url

logger = logging.getLogger(__name__)

FORMAT = "loomax-checkpoint/1"
_VERSIONED = ("loomax", "jax", "jaxlib", "haliax", "equinox", "optax", "tensorstore", "numpy")


class CheckpointSaveError(UserError, OSError):
    """A checkpoint could not be written (full disk, no permission, a store refusing it).

    The run stops; the checkpoints already complete stay loadable and the next start
    resumes from the newest of them.
    """


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
        check_writable(self.directory)

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


def check_writable(directory: Directory | str) -> None:
    """Raise ``ConfigError`` naming ``trainer.checkpointer.base_path`` if ``directory`` (or
    URL) cannot be written; process 0 checks, before any work that would be lost (and
    before JAX's backend starts: ``process_index_before_backend``)."""
    if process_index_before_backend() == 0:
        directory = directory if isinstance(directory, Directory) else Directory(directory)
        try:
            directory.check_writable()
        except OSError as e:
            raise ConfigError(f"trainer.checkpointer.base_path: {e}") from e
