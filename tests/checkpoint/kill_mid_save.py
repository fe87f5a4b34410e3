"""``loomax train`` with one more hook type, ``test_kill_mid_save``: SIGKILL itself mid-save.

Run as ``python kill_mid_save.py train --config_path ... --trainer.hooks '[{type:
test_kill_mid_save, step: N}]'``. The hook is declared the way users declare theirs; it
waits, inside the process, until the asynchronous save of step N has written some files
but not its ``metadata.json``, then kills the process: a kill that always lands mid-save.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loomax.cli import main
from loomax.train import Hook, HookConfig, hook_type


@hook_type("test_kill_mid_save")
class KillMidSave(Hook):
    @dataclass(frozen=True)
    class Config(HookConfig):
        step: int = 5
        """The step whose save is interrupted."""

    def on_save(self, info, path: str) -> None:
        if info.step != self.config.step:
            return
        directory = Path(path.removeprefix("file://"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            files = [p for p in directory.rglob("*") if p.is_file()] if directory.exists() else []
            if (directory / "metadata.json").exists():
                sys.exit(f"the save of step {info.step} finished before it could be interrupted")
            if files:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0002)
        sys.exit("no file of the save appeared")


if __name__ == "__main__":
    main(sys.argv[1:])
