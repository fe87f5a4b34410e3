"""Control server: stop or checkpoint a running job over HTTP on 127.0.0.1.

Process 0 serves on ``127.0.0.1:<port>`` (port 0 = any free port) and writes
``<run_dir>/control.json`` with the ``url`` and a random ``token`` (file mode 0600).
Every request needs ``Authorization: Bearer <token>`` (401 otherwise):

- ``GET /status``: step, ``max_steps``, last finished loss, the last logged metrics
  (``metrics``, of step ``logged_step``), pending commands
- ``POST /stop``, ``POST /save``, ``POST /save_and_stop``: done at the end of the current step
- ``POST /abort``: stop at the end of the current step without saving; the run fails
  with ``RunAborted`` on every process

A command becomes a request on ``info.control``; the trainer's step agreement makes
process 0's decision every process's. An abort is a stop that every process agrees on,
marked in the JAX coordination service's key-value store; each process then raises in
``on_train_end``, before the final checkpoint. ``loomax control RUN_DIR status|stop|save|abort``
(``loomax.hooks.control_client``) sends them.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from loomax.atomic_files import replace_file
from loomax.distributed import coordination_client
from loomax.errors import TrainingFailure
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

COMMANDS = ("stop", "save", "save_and_stop", "abort")
CONTROL_FILE = "control.json"


class RunAborted(TrainingFailure, RuntimeError):
    """The run was aborted over the control server: stopped at once, no checkpoint saved."""


@hook_type("control")
class ControlServerHook(Hook):
    """Serves the control API while training (only where ``serve`` is true: process 0)."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """HTTP control on 127.0.0.1 (GET /status, POST /stop, /save, /save_and_stop, /abort) with a bearer token."""

        port: int = 0
        """Port on 127.0.0.1; 0 = any free port (the URL is written to <run_dir>/control.json)."""

        def __post_init__(self):
            self.check(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")

    config: Config
    every = 1
    priority = 100  # commands reach the control object before the other hooks run

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        run_dir: str | Path,
        serve: bool = True,
        max_steps: int | None = None,
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.run_dir = Path(run_dir)
        self.serve = serve
        self.max_steps = max_steps
        self._logged: tuple[int, dict[str, Any]] | None = None
        self._aborted: str | None = None
        self.token = secrets.token_urlsafe(24)
        self.url: str | None = None
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._status: dict[str, Any] = {"step": None, "loss": None, "state": "starting"}

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        trainer = context.trainer_config
        max_steps = trainer.num_train_steps if trainer else None
        return cls(config, run_dir=context.run_dir, serve=context.primary, max_steps=max_steps)

    @property
    def control_file(self) -> Path:
        return self.run_dir / CONTROL_FILE

    def on_train_begin(self, info: StepInfo) -> None:
        if not self.serve:
            return
        self._server = ThreadingHTTPServer(("127.0.0.1", self.config.port), _handler(self))
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}"
        threading.Thread(
            target=self._server.serve_forever, name="control-server", daemon=True
        ).start()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        served = {"url": self.url, "token": self.token, "pid": os.getpid()}
        replace_file(self.control_file, lambda f: json.dump(served, f), mode=0o600)
        self._update(info, "training")
        logger.info("control server at %s (token in %s)", self.url, self.control_file)

    def on_step(self, info: StepInfo) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if "abort" in pending and self._aborted is None:
            self._aborted = f"aborted over HTTP at step {info.step}"
            client = coordination_client()
            if client is not None:  # the other processes read it once they stop here too
                client.key_value_set(self._abort_key(info.step) + "reason", self._aborted)
            info.control.stop(self._aborted, by="control server")
            pending = [c for c in pending if c != "abort"]
        for command in pending:
            if command in ("save", "save_and_stop"):
                info.control.save(by="control server")
            if command in ("stop", "save_and_stop"):
                info.control.stop(f"{command} over HTTP", by="control server")
        self._update(info, "training")

    def pre_log(self, info: StepInfo, record: dict[str, Any]) -> None:
        self._logged = (info.step, record)  # read at the next step, once it is logged

    def blocks_temporary_saves(self, step: int) -> bool:
        return self._aborted is not None  # an aborted run saves nothing more

    def on_train_end(self, info: StepInfo) -> None:
        self._shutdown()
        reason = self._aborted
        client = coordination_client()
        if reason is None and client is not None:
            marks = client.key_value_dir_get(self._abort_key(info.step))
            reason = marks[0][1] if marks else None
        if reason is not None:  # raised before the final checkpoint, on every process
            raise RunAborted(f"{reason}: no checkpoint saved")

    def _abort_key(self, step: int) -> str:
        """The key-value directory where process 0 marks an abort at ``step``."""
        return f"loomax/control_server/abort/{self.run_dir}/{step}/"

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        self._shutdown()

    def _update(self, info: StepInfo, state: str) -> None:
        done = info.previous
        logged_step, record = self._logged or (None, {})
        metrics = {k: _scalar(v) for k, v in record.items() if _scalar(v) is not None}
        with self._lock:
            self._status = {
                "step": info.step,
                "max_steps": self.max_steps,
                "finished_step": done.step if done else None,
                "loss": done.metrics.get("train/loss") if done else None,
                "logged_step": logged_step,
                "metrics": metrics,
                "state": state,
                "pending": list(self._pending),
            }

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            self.control_file.unlink(missing_ok=True)

    # called from the server's threads
    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._status)

    def submit(self, command: str) -> None:
        with self._lock:
            self._pending.append(command)
        logger.warning("control server: %s requested", command)


def _scalar(value: Any) -> float | int | None:
    """A logged value as a JSON number, or None if it is not one (text, histograms)."""
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        value = value.item()
    return value if isinstance(value, int | float) else None


def _handler(hook: ControlServerHook) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {hook.token}".encode()):
                return True
            self._reply(401, {"error": "missing or wrong bearer token (see control.json)"})
            return False

        def do_GET(self):  # noqa: N802 - http.server's naming
            if not self._authorized():
                return
            if self.path.rstrip("/") == "/status":
                self._reply(200, hook.status())
            else:
                self._reply(404, {"error": f"unknown path {self.path}; GET /status"})

        def do_POST(self):  # noqa: N802
            if not self._authorized():
                return
            command = self.path.strip("/")
            if command not in COMMANDS:
                self._reply(404, {"error": f"unknown command {self.path}; POST one of {COMMANDS}"})
                return
            hook.submit(command)
            self._reply(202, {"accepted": command})

        def _reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # noqa: A002 - quiet: the hook logs commands
            logger.debug(format, *args)

    return Handler
