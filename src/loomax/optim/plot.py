"""Plot a learning-rate schedule to a PNG (matplotlib, from the ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from loomax.errors import MissingPackageError


def require_pyplot():
    """``matplotlib.pyplot`` with a headless backend, or a clear error naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingPackageError(
            "plotting needs matplotlib: pip install 'loomax[plot]' (or pip install matplotlib)"
        ) from e
    return plt


def schedule_values(schedule: Callable, num_train_steps: int, points: int = 2000) -> tuple:
    """``(steps, learning rates)`` sampled over training (every step when short)."""
    steps = np.unique(np.linspace(0, num_train_steps, min(points, num_train_steps + 1)).astype(int))
    return steps, np.asarray([float(schedule(int(s))) for s in steps])


def plot_schedule(
    schedule: Callable, num_train_steps: int, out: str | Path, *, title: str = "learning rate"
) -> Path:
    """Save the schedule as a PNG at ``out``, with each phase boundary marked."""
    plt = require_pyplot()
    steps, lrs = schedule_values(schedule, num_train_steps)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(steps, lrs)
    for phase in getattr(schedule, "phases", lambda: [])():
        ax.axvline(phase.start, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
