"""Decisions every process must take at the same step: save now, stop now.

A wall-clock save interval, a time limit or a SIGTERM reaching one host would make
processes disagree, and a save or stop on some processes only deadlocks the others.
``StepAgreement`` makes process 0's decision everyone's, through the JAX coordination
service (one small key-value exchange per step, only with more than one process); a
stop requested by any process reaches process 0 and from there everyone.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax

from loomax.distributed import coordination_client

_PREFIX = "loomax/control"
_KEEP_STEPS = 100  # processes never drift this many steps apart: each step has collectives


class StepAgreement:
    """``agree(step, proposal)`` returns the decision every process takes at ``step``."""

    def __init__(self, timeout: float = 3600.0):
        self._timeout_ms = int(timeout * 1000)
        self._client = coordination_client()
        self._requested_stop = False

    def agree(self, step: int, proposal: dict[str, Any]) -> dict[str, Any]:
        """Process 0's ``proposal``, with ``stop`` set if any process proposed one."""
        if self._client is None:
            return proposal
        pid = jax.process_index()
        if pid != 0:
            if proposal.get("stop") and not self._requested_stop:
                self._client.key_value_set(f"{_PREFIX}/stop/{pid}", str(proposal["stop"]))
                self._requested_stop = True
            return json.loads(
                self._client.blocking_key_value_get(f"{_PREFIX}/step/{step}", self._timeout_ms)
            )
        decision = dict(proposal)
        if not decision.get("stop"):
            requests = self._client.key_value_dir_get(f"{_PREFIX}/stop/")
            if requests:
                key, reason = requests[0]
                decision["stop"] = f"{reason} (process {key.rsplit('/', 1)[-1]})"
        self._client.key_value_set(f"{_PREFIX}/step/{step}", json.dumps(decision))
        if step > _KEEP_STEPS:
            self._client.key_value_delete(f"{_PREFIX}/step/{step - _KEEP_STEPS}")
        return decision


class StopSignals:
    """Turns SIGTERM and SIGINT into a stop request (a second SIGINT interrupts at once)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = name

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Install the handlers for the duration (only possible on the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
