"""Cancel a run from the W&B UI: tag it (e.g. ``cancel``) and it stops cleanly.

On process 0, a background thread reads the wandb run's tags through the W&B public API
every ``check_seconds``; once one of ``cancel_tags`` is there, the hook asks for a stop
at the end of the current step (every process stops there, after the final checkpoint).
An offline or disabled wandb run has no tags to read on a server: the hook says so once
and does nothing (unless given its own ``read_tags``).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

TagReader = Callable[[Any], list[str]]
"""``read_tags(wandb_run) -> tags``: the run's tags as the W&B server has them now."""


def server_tags(run: Any) -> list[str]:
    """The tags of ``run`` on the W&B server (public API: what the UI shows)."""
    import wandb

    return list(wandb.Api().run(run.path).tags)


@hook_type("wandb_cancel")
class WandbCancelHook(Hook):
    """Stops the run once the wandb run carries one of ``cancel_tags`` (process 0 checks)."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Stop the run (cleanly, after a checkpoint) when it is tagged in the W&B UI."""

        cancel_tags: list[str] = field(default_factory=lambda: ["cancel"])
        """Tags that cancel the run when added in the W&B UI."""
        check_seconds: float = 60.0
        """Read the run's tags from the W&B server every this many seconds."""

        def __post_init__(self):
            self.check(bool(self.cancel_tags), "cancel_tags must name at least one tag")
            self.check_positive("check_seconds")

    config: Config
    priority = 90  # its stop reaches the control object before most hooks run

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        enabled: bool = True,
        read_tags: TagReader = server_tags,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.enabled = enabled
        self.read_tags = read_tags
        self.found: str | None = None
        """The cancel tag found on the run, once it is."""
        self.watching = False
        """Whether tags are being checked (a wandb run online, on process 0)."""
        self._asked = False
        self._done = threading.Event()

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, enabled=context.primary)

    def on_train_begin(self, info: StepInfo) -> None:
        if not self.enabled:
            return
        wandb = sys.modules.get("wandb")  # never imported: no wandb run
        run = getattr(wandb, "run", None)
        if run is None:
            logger.warning("wandb_cancel: no wandb run is active (trainer.tracker): off")
            return
        offline = run.settings.mode in ("offline", "dryrun", "disabled")
        if offline and self.read_tags is server_tags:
            logger.warning(
                "wandb_cancel: the wandb run is %s, so its tags cannot be read from the "
                "W&B server: cancelling by tag is off",
                run.settings.mode,
            )
            return
        self.watching = True
        self._done.clear()
        threading.Thread(target=self._watch, args=(run,), name="wandb-cancel", daemon=True).start()

    def on_step(self, info: StepInfo) -> None:
        if self.found is not None and not self._asked:
            self._asked = True
            info.control.stop(f"the wandb run was tagged {self.found!r}")

    def on_train_end(self, info: StepInfo) -> None:
        self._done.set()

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        self._done.set()

    def _watch(self, run: Any) -> None:
        warned = False
        while not self._done.wait(self.config.check_seconds):
            try:
                tags = set(self.read_tags(run))
            except Exception as error:  # noqa: BLE001 - a failed check must not stop training
                if not warned:
                    logger.warning("wandb_cancel: could not read the run's tags: %s", error)
                    warned = True
                continue
            found = [t for t in self.config.cancel_tags if t in tags]
            if found:
                self.found = found[0]
                logger.warning("wandb_cancel: the run is tagged %r: stopping", found[0])
                return
