"""``loomax control RUN_DIR status|stop|save|save_and_stop|abort``: talk to a run's control server.

The server (``{type: control}``) writes ``<run_dir>/control.json`` with its URL and token;
the client reads it and sends the command with the bearer token.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loomax.errors import MissingFileError, UserError
from loomax.hooks.control_server import COMMANDS, CONTROL_FILE

ACTIONS = ("status", *COMMANDS)


def send(run_dir: str | Path, action: str, *, timeout: float = 10.0) -> dict[str, Any]:
    """Send ``action`` to the control server of the run in ``run_dir``; returns its JSON reply."""
    if action not in ACTIONS:
        raise UserError(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
    path = Path(run_dir) / CONTROL_FILE
    try:
        served = json.loads(path.read_text())
    except FileNotFoundError:
        raise MissingFileError(
            f"{path} not found: no control server is running for {run_dir} (the run needs a "
            "trainer.hooks entry {type: control}, and writes the file once training starts)"
        ) from None
    method = "GET" if action == "status" else "POST"
    request = urllib.request.Request(
        f"{served['url']}/{action}",
        method=method,
        data=b"" if method == "POST" else None,
        headers={"Authorization": f"Bearer {served['token']}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise UserError(f"the control server answered {e.code}: {e.read().decode()}") from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(
            f"the control server at {served['url']} does not answer ({e}): has the run ended?"
        ) from None
