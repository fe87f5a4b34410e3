"""Token caches built on background threads while training reads what is ready.

`BackgroundBuilds` runs one build per train source on a thread of its own (each drives
the Ray build, under the cache's lease: `token_cache.shared`), logs how far each is every
`say_every_s` seconds, keeps the error of a build that failed for the loader to raise,
and stops them (finished shards stay in the ledger) when the run ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from loomax.data.growing_windows import GrowingWindows
from loomax.data.token_cache.build import BuildStopped
from loomax.data.token_cache.settings import TokenCacheInfo
from loomax.distributed import RayConfig

logger = logging.getLogger(__name__)

SAY_EVERY_S = 30.0
"""Seconds between the log lines saying how far the builds are."""


class BackgroundBuilds:
    """Builds running on threads; `start` one per cache, `close` when training ends."""

    def __init__(self, ray: RayConfig | None, say_every_s: float = SAY_EVERY_S) -> None:
        self._ray = ray
        self._stop = threading.Event()
        self._ray_lock = threading.Lock()
        self._ray_started = False
        self._threads: list[threading.Thread] = []
        self._errors: dict[str, BaseException] = {}
        self.infos: dict[str, TokenCacheInfo] = {}
        """What each finished build made, by name."""
        self._watched: list[GrowingWindows] = []
        self._say_every_s = say_every_s
        self._monitor: threading.Thread | None = None
        self._training = threading.Event()

    def ensure_ray(self) -> None:
        """Joins or starts Ray once, from the first build that tokenizes (not per thread)."""
        if self._ray is None:
            return
        from loomax.distributed import init_ray

        with self._ray_lock:
            self._ray_started |= init_ray(self._ray)

    def start(
        self,
        name: str,
        build: Callable[[Callable[[], bool]], TokenCacheInfo],
        windows: GrowingWindows,
    ) -> None:
        """Runs `build(should_stop)` on a thread; `windows` are what it fills (for the log)."""

        def run() -> None:
            begun = time.monotonic()
            try:
                info = build(self._stop.is_set)
            except BuildStopped:
                logger.info("token cache of %s: build stopped; rerun to resume it", name)
                return
            except BaseException as error:  # noqa: BLE001 - handed to the loader
                self._errors[name] = error
                logger.error("token cache of %s failed: %s", name, error)
                return
            self.infos[name] = info
            windows.refresh()
            logger.info(
                "token cache of %s complete in %.0f s: %s",
                name,
                time.monotonic() - begun,
                windows.progress(),
            )
            if info.documents_skipped:
                logger.warning(
                    "token cache of %s skipped %d bad record(s), first: %s",
                    name,
                    info.documents_skipped,
                    "; ".join(info.skipped_examples[:3]),
                )

        thread = threading.Thread(target=run, daemon=True, name=f"cache-build {name}")
        self._threads.append(thread)
        self._watched.append(windows)
        thread.start()
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._say, daemon=True, name="cache-progress")
            self._monitor.start()

    def held(self) -> bool:
        """Whether the builds still hold back their shards past the first chunk (until
        `training_started`: the run's compiles get a core of their own)."""
        return not self._training.is_set()

    def training_started(self) -> None:
        """Called after the first training step: the builds go on at full width."""
        self._training.set()

    def error(self, name: str) -> BaseException | None:
        """The error of `name`'s build, if it failed."""
        return self._errors.get(name)

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def _say(self) -> None:
        while not self._stop.wait(self._say_every_s) and self.running:
            for windows in self._watched:
                if not windows.complete:
                    windows.refresh()
                    logger.info("token cache of %s: %s", windows.name, windows.progress())

    def join(self, timeout: float | None = None) -> None:
        """Waits for the builds to end (for tests and benchmarks)."""
        for thread in self._threads:
            thread.join(timeout)

    def close(self) -> None:
        """Stops the builds still running (their finished shards are kept) and Ray if started here."""
        if self.running:
            logger.info("training ended before the token cache was complete: stopping its build")
        self._stop.set()
        self._training.set()
        self.join()
        if self._monitor is not None:
            self._monitor.join()
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False
