"""Requests hooks make (``Control``) and decisions every process must take at the same step.

``Control`` collects what hooks ask for during a step: stop, save or evaluate at the
end of it, with who asked.

A wall-clock save interval, a time limit or a SIGTERM reaching one host would make
processes disagree, and a save or stop on some processes only deadlocks the others.
``StepAgreement`` makes process 0's decision everyone's, through the JAX coordination
service (one small key-value exchange per step, only with more than one process); a
stop requested by any process reaches process 0 and from there everyone. Each
``Trainer.train`` call makes one ``StepAgreement``, numbered alike on every process, and
its keys live under that number: a second ``train`` in the same processes (``loomax
ladder run``) never reads the first one's decisions.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import jax

from loomax.distributed import coordination_client

logger = logging.getLogger(__name__)

_PREFIX = "loomax/control"
_KEEP_STEPS = 100  # processes never drift this many steps apart: each step has collectives
_agreements = itertools.count()
"""Numbers this process's ``StepAgreement``s (one per ``train`` call, in the same order on
every process): agreement N keeps its keys under ``loomax/control/N/``."""
_cleared_below = 0
"""Process 0: the keys of agreements below this number are deleted."""


SaveKind = Literal["permanent", "temporary"]


@dataclass(frozen=True)
class Decision:
    """What the trainer does at the end of a step, in this order: ``eval``, ``save``, ``stop``."""

    eval: bool = False
    """Run the evaluators."""
    save: SaveKind | None = None
    """Save a checkpoint: a permanent one (kept by the retention policy) or a temporary one."""
    stop: str | None = None
    """Why to stop after this step; None = go on."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Decision:
        return cls(**json.loads(text))


class Control:
    """What hooks request for the end of the current step: ``stop``, ``save``, ``eval``.

    Every hook sees the same object as ``info.control``. The trainer acts on the
    requests once the step's hooks have run (all processes take process 0's decision)
    and logs which hook asked (``by``, filled in with the running hook's name).
    """

    def __init__(self):
        self.running: str | None = None
        """Name of the hook the trainer is running (the default ``by`` of a request)."""
        self.clear()

    def clear(self) -> None:
        """Forget the requests (the trainer calls this after acting on them)."""
        self.stop_reason: str | None = None
        self.save_requested = False
        self.eval_requested = False
        self.requested_by: list[str] = []

    def stop(self, reason: str, *, by: str | None = None) -> None:
        """Stop training after this step (after the eval and save asked for, and a final checkpoint)."""
        who = by or self.running or "user"
        if self.stop_reason is None:
            self.stop_reason = f"{reason} (requested by {who})"
        self._note("stop", who)

    def save(self, *, by: str | None = None) -> None:
        """Save a (permanent) checkpoint after this step."""
        self.save_requested = True
        self._note("save", by or self.running or "user")

    def eval(self, *, by: str | None = None) -> None:
        """Run the evaluators after this step."""
        self.eval_requested = True
        self._note("eval", by or self.running or "user")

    def _note(self, what: str, who: str) -> None:
        self.requested_by.append(f"{what} by {who}")
        logger.info("%s requested by %s", what, who)

    def proposal(self) -> Decision:
        """The requests as a decision (a requested save is a permanent one)."""
        return Decision(
            eval=self.eval_requested,
            save="permanent" if self.save_requested else None,
            stop=self.stop_reason,
        )


class StepAgreement:
    """``agree(step, proposal)`` returns the ``Decision`` every process takes at ``step``.

    Make one per ``train`` call, on every process: the keys of each live under its own
    number, so no call sees another's decisions or stop requests.
    """

    def __init__(self, timeout: float = 3600.0):
        self._timeout_ms = int(timeout * 1000)
        self._client = coordination_client()
        self._requested_stop = False
        self.number = next(_agreements)
        """This agreement's number: the same on every process for the same ``train`` call."""
        self._prefix = f"{_PREFIX}/{self.number}"
        self._agreed = 0

    def agree(self, step: int, proposal: Decision) -> Decision:
        """Process 0's ``proposal``, with ``stop`` set if any process proposed one."""
        if self._client is None:
            return proposal
        pid = jax.process_index()
        if pid != 0:
            if proposal.stop and not self._requested_stop:
                self._client.key_value_set(f"{self._prefix}/stop/{pid}", proposal.stop)
                self._requested_stop = True
            return Decision.from_json(
                self._client.blocking_key_value_get(f"{self._prefix}/step/{step}", self._timeout_ms)
            )
        decision = proposal
        if not decision.stop:
            requests = self._client.key_value_dir_get(f"{self._prefix}/stop/")
            if requests:
                key, reason = requests[0]
                stop = f"{reason} (process {key.rsplit('/', 1)[-1]})"
                decision = dataclasses.replace(decision, stop=stop)
        self._client.key_value_set(f"{self._prefix}/step/{step}", decision.to_json())
        self._agreed += 1
        if step > _KEEP_STEPS:
            self._client.key_value_delete(f"{self._prefix}/step/{step - _KEEP_STEPS}")
        if self._agreed == _KEEP_STEPS:  # every process is in this call by now
            self._clear_earlier()
        return decision

    def _clear_earlier(self) -> None:
        """Delete what the earlier agreements left (their last steps, their stop requests)."""
        global _cleared_below
        for number in range(_cleared_below, self.number):
            self._client.key_value_delete(f"{_PREFIX}/{number}/")
        _cleared_below = max(_cleared_below, self.number)


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
