"""``trainer.shutdown_at_exit``: power the machine off a while after the run ends.

Meant for cloud VMs billed while they run: the run schedules the operating system's own
delayed power-off (``sudo shutdown -h +MINUTES``), so it happens even if Python is gone.
Cancel it with ``sudo shutdown -c``.
"""

from __future__ import annotations

import logging
import math
import subprocess
from datetime import timedelta

logger = logging.getLogger(__name__)

COMMAND = ("sudo", "shutdown", "-h", "+{minutes}")
"""The power-off command; ``{minutes}`` is the delay in whole minutes (rounded up)."""


def schedule_shutdown(delay: timedelta, command: tuple[str, ...] | None = None) -> None:
    """Schedule the power-off ``delay`` from now; a failure is logged, never raised."""
    minutes = math.ceil(delay.total_seconds() / 60)
    argv = [part.format(minutes=minutes) for part in (command or COMMAND)]
    logger.warning("trainer.shutdown_at_exit: powering this machine off in %d min", minutes)
    try:
        subprocess.run(argv, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        logger.error("trainer.shutdown_at_exit: %s failed: %s", " ".join(argv), error)
