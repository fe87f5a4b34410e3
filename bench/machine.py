"""What the bench scripts say about the machine their figures come from."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else ``platform.processor()``), named beside
    every CPU figure: ratios follow the CPU's matmul library."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
