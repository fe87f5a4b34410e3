"""Control server: stop or checkpoint a running job over HTTP on 127.0.0.1.

Process 0 serves on ``127.0.0.1:<port>`` (port 0 = any free port) and writes
``<run_dir>/control.json`` with the ``url`` and a random ``token`` (file mode 0600).
Every request needs ``Authorization: Bearer <token>`` (401 otherwise):

- ``GET /status``: step, last finished loss, pending commands
- ``POST /stop``, ``POST /save``, ``POST /save_and_stop``: done at the end of the current step

A command becomes a request on ``info.control``; the trainer's step agreement makes
process 0's decision every process's.
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
from loomax.train.hook_config import HookConfig, HookContext, hook_type
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

COMMANDS = ("stop", "save", "save_and_stop")


@hook_type("control")
class ControlServerHook(Hook):
    """Serves the control API while training (only where ``serve`` is true: process 0)."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        """HTTP control on 127.0.0.1 (GET /status, POST /stop, /save, /save_and_stop) with a bearer token."""

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
        **settings: Any,
    ):
        super().__init__(config, **settings)
        self.run_dir = Path(run_dir)
        self.serve = serve
        self.token = secrets.token_urlsafe(24)
        self.url: str | None = None
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._status: dict[str, Any] = {"step": None, "loss": None, "state": "starting"}

    @classmethod
    def from_config(cls, config: Config, context: HookContext) -> Hook:
        return cls(config, run_dir=context.run_dir, serve=context.primary)

    @property
    def control_file(self) -> Path:
        return self.run_dir / "control.json"

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
        for command in pending:
            if command in ("save", "save_and_stop"):
                info.control.save(by="control server")
            if command in ("stop", "save_and_stop"):
                info.control.stop(f"{command} over HTTP", by="control server")
        self._update(info, "training")

    def on_train_end(self, info: StepInfo) -> None:
        self._shutdown()

    def on_error(self, info: StepInfo, error: BaseException) -> None:
        self._shutdown()

    def _update(self, info: StepInfo, state: str) -> None:
        done = info.previous
        with self._lock:
            self._status = {
                "step": info.step,
                "finished_step": done.step if done else None,
                "loss": done.metrics.get("train/loss") if done else None,
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
