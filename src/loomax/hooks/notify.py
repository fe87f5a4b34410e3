"""Notifications: a message to a webhook (Slack or any URL) when the run starts, ends,
fails or diverges, and every N steps with chosen metrics; optionally a W&B alert too.

The URL is a secret (a Slack webhook's path is its key): it comes from ``url`` or the
environment variable ``url_env``, and it is never logged nor written into a saved config
(``config.yaml``, checkpoints, trackers' hyperparameters show ``url: null``). Posts go
out from a background thread; one that fails is a warning, never a stop. Only process 0
posts.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import os
import queue
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import draccus

from loomax.config import ConfigError
from loomax.hooks.divergence import DivergenceDetector, DivergenceError
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

EVENTS = ("start", "end", "failure", "divergence")
FORMATS = ("slack", "json")
_WANDB_LEVELS = {"start": "INFO", "end": "INFO", "failure": "ERROR", "divergence": "WARN"}
_MAX_ERROR_CHARS = 2000


class Secret(str):
    """A string config value that is never shown: its repr hides it and a saved config
    holds ``null`` in its place (draccus encodes it so)."""

    def __repr__(self) -> str:
        return "'<secret>'"


draccus.encode.register(Secret, lambda value, _=None: None)
draccus.decode.register(Secret, lambda value: Secret(value))


@hook_type("notify")
class NotifyHook(Hook):
    """Posts ``{"text": ...}`` (format ``slack``) or the event as JSON (format ``json``)."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """Notify a webhook (Slack or any URL) on start, end, failure, divergence and every N steps."""

        url: Secret | None = None
        """URL to POST to (never logged nor saved); null = the environment variable url_env."""
        url_env: str = "LOOMAX_NOTIFY_URL"
        """Environment variable holding the URL when url is null."""
        events: list[str] = field(default_factory=lambda: list(EVENTS))
        """Events to notify: start, end, failure (with the error), divergence."""
        every: int | None = None
        """Also post the chosen metrics every this many steps; null = never."""
        metrics: list[str] = field(default_factory=lambda: ["train/loss", "eval/loss"])
        """Glob patterns of the metrics in the every-N message (step metrics, logged values, last eval)."""
        format: str = "slack"
        """slack: {"text": ...}; json: {"text", "event", "run", "step", "metrics", "error"}."""
        timeout: float = 10.0
        """Seconds one post may take; at the end the last posts get this long to go out."""
        wandb_alert: bool = False
        """Also raise a W&B alert (wandb.alert) on the same events, in the run's wandb run."""

        def __post_init__(self):
            if self.url is not None and not isinstance(self.url, Secret):
                object.__setattr__(self, "url", Secret(self.url))  # hidden from now on
            self.check(
                self.url is None or self.url.startswith(("http://", "https://")),
                "url must start with http:// or https:// (its value is not shown)",
            )
            bad = [e for e in self.events if e not in EVENTS]
            self.check(not bad, f"events must be among {list(EVENTS)}, got {bad}")
            self.check_positive("every")
            self.check(
                self.format in FORMATS, f"format must be one of {FORMATS}, got {self.format!r}"
            )
            self.check_positive("timeout")
            self.check(bool(self.url_env), "url_env must name an environment variable")

    config: Config
    sees_every_step = True  # every-N posts keep their own cadence; divergence is seen at once
    priority = -1000  # after the other hooks: it sees the stops they asked for in this step

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        run_name: str = "run",
        num_train_steps: int | None = None,
        post: bool = True,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        c = self.config
        self.run_name = run_name
        self.num_train_steps = num_train_steps
        self.post = post
        url = c.url or os.environ.get(c.url_env) or None
        if post and url is None and not c.wandb_alert:
            raise ConfigError(
                f"trainer.hooks (notify): no URL to post to: set url, or the environment "
                f"variable {c.url_env} (url_env), or wandb_alert: true"
            )
        if url is not None and not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"trainer.hooks (notify): the URL in ${c.url_env} must start with http:// or "
                "https:// (its value is not shown)"
            )
        self._sender = _Sender(Secret(url), c.timeout) if post and url else None
        self._notified: set[str] = set()
        self._stop_reason: str | None = None
        self._last_eval: dict[str, float] = {}

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        trainer = context.trainer_config
        return cls(
            config,
            run_name=context.run_dir.name if context.run_dir else "run",
            num_train_steps=trainer.num_train_steps if trainer else None,
            post=context.primary,
        )

    @property
    def failed_posts(self) -> int:
        """Posts that did not go through (each was a warning)."""
        return self._sender.failures if self._sender else 0

    # ------------------------------------------------------------------ events
    def on_train_begin(self, info: StepInfo) -> None:
        total = f" of {self.num_train_steps}" if self.num_train_steps else ""
        self._event("start", info.step, f"{self.run_name} started at step {info.step}{total}")

    def on_step(self, info: StepInfo) -> None:
        self._watch_stops(info)
        every = self.config.every
        if every and info.step % every == 0 and self._sender is not None:
            values = {**info.host_metrics(), **info.record, **self._last_eval}
            chosen = {
                k: float(v)
                for k, v in values.items()
                if isinstance(v, int | float)
                and any(fnmatch.fnmatch(k, p) for p in self.config.metrics)
            }
            shown = ", ".join(f"{k} {_number(v)}" for k, v in sorted(chosen.items()))
            self._send("metrics", info.step, f"{self.run_name} step {info.step}: {shown}", chosen)

    def on_eval(self, info: StepInfo, results: dict[str, float]) -> None:
        self._last_eval = {k: v for k, v in results.items() if isinstance(v, int | float)}
        self._watch_stops(info)  # a detector watching an eval metric asks here

    def on_train_end(self, info: StepInfo) -> None:
        total = self.num_train_steps
        if total is None or info.step >= total:
            text = f"{self.run_name} finished at step {info.step}"
        else:
            why = f": {self._stop_reason}" if self._stop_reason else ""
            text = f"{self.run_name} stopped at step {info.step} of {total}{why}"
        self._event("end", info.step, text)
        self._close()

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        message = f"{type(error).__name__}: {error}"[:_MAX_ERROR_CHARS]
        if isinstance(error, DivergenceError) and "divergence" in self.config.events:
            self._event(
                "divergence", info.step, f"{self.run_name} diverged: {message}", error=message
            )
        else:
            text = f"{self.run_name} failed at step {info.step}: {message}"
            self._event("failure", info.step, text, error=message)
        self._close()

    def _watch_stops(self, info: StepInfo) -> None:
        reason = info.control.stop_reason
        if reason is None:
            return
        self._stop_reason = reason
        if f"stop by {DivergenceDetector.__name__}" in info.control.requested_by:
            self._event("divergence", info.step, f"{self.run_name} diverged: {reason}")

    # ------------------------------------------------------------------ sending
    def _event(self, event: str, step: int, text: str, *, error: str | None = None) -> None:
        if event not in self.config.events or event in self._notified or not self.post:
            return
        self._notified.add(event)
        self._send(event, step, text, error=error)
        if self.config.wandb_alert:
            _wandb_alert(f"{self.run_name}: {event}", text, _WANDB_LEVELS[event])

    def _send(self, event, step, text, metrics=None, *, error=None) -> None:
        if self._sender is None:
            return
        if self.config.format == "slack":
            payload: dict[str, Any] = {"text": text}
        else:
            payload = {"text": text, "event": event, "run": self.run_name, "step": step}
            shown = {k: v if math.isfinite(v) else str(v) for k, v in (metrics or {}).items()}
            payload.update({"metrics": shown, "error": error})  # strict JSON: NaN as "nan"
        self._sender.submit(event, payload)

    def _close(self) -> None:
        if self._sender is not None:
            self._sender.drain(self.config.timeout)


class _Sender:
    """POSTs JSON payloads to one URL from a daemon thread; failures are warnings."""

    def __init__(self, url: Secret, timeout: float):
        self._url = url
        self._timeout = timeout
        self._queue: queue.Queue = queue.Queue()
        self.failures = 0
        threading.Thread(target=self._run, name="notify", daemon=True).start()

    def submit(self, event: str, payload: dict[str, Any]) -> None:
        self._queue.put((event, json.dumps(payload, default=str).encode()))

    def drain(self, timeout: float) -> None:
        """Wait (at most about ``timeout`` seconds) for what was submitted to be posted."""
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout + 1):
            logger.warning("notify: notifications still unsent after %.0fs, left behind", timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            event, body = item
            request = urllib.request.Request(
                self._url, data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self._timeout) as response:
                    response.read()
            except Exception as error:  # noqa: BLE001 - a failed post must never stop training
                self.failures += 1
                logger.warning(
                    "notify: could not post the %s notification (training goes on): %s",
                    event,
                    _without(str(error), self._url) or type(error).__name__,
                )


def _without(text: str, url: str) -> str:
    """``text`` with the URL (and its path, the secret part of a webhook) taken out."""
    path = url.split("://", 1)[-1].partition("/")[2]
    text = text.replace(url, "<url>")
    return text.replace(path, "<path>") if path else text


def _wandb_alert(title: str, text: str, level: str) -> None:
    """A W&B alert in the wandb run of this process, if one is running (warn otherwise)."""
    wandb = sys.modules.get("wandb")  # never imported: no wandb run to alert in
    run = getattr(wandb, "run", None)
    if run is None:
        logger.warning("notify: wandb_alert is on but no wandb run is active (trainer.tracker)")
        return
    try:
        run.alert(title=title[:63], text=text, level=level)
    except Exception as error:  # noqa: BLE001 - an alert must never stop training
        logger.warning("notify: wandb alert failed (training goes on): %s", error)


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)
