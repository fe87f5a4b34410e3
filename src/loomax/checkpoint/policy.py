"""When checkpoints are saved and which are deleted: the ``trainer.checkpointer`` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

REMOVAL_STRATEGIES = ("ephemeral_only", "all_non_permanent", "never")
"""Values of ``trainer.checkpointer.removal``."""


@dataclass(frozen=True)
class KeepPolicy:
    """Keep a permanent checkpoint every ``every`` steps, up to step ``until``."""

    every: int = 10000
    """Save a permanent checkpoint at steps divisible by this."""
    until: int | None = None
    """Last step this policy applies to; null = to the end of training."""


@dataclass(frozen=True)
class CheckpointerConfig:
    """The ``trainer.checkpointer`` section: where checkpoints go and when they are saved."""

    base_path: str | None = None
    """Directory or URL (gs://, s3://, anything tensorstore supports) of the checkpoints; null = <run_dir>/checkpoints."""
    save_interval: timedelta | None = timedelta(minutes=15)
    """Wall time between temporary checkpoints (deleted once a newer one commits), e.g. 15m; null = none."""
    keep: list[KeepPolicy] = field(default_factory=lambda: [KeepPolicy(10000)])
    """Permanent checkpoints: a list of {every: N, until: M} step policies, in increasing `until`."""
    delete_old_temp_checkpoints: bool = True
    """Also delete temporary checkpoints left by an earlier attempt of this run once a newer one commits."""
    save_at_end: bool = True
    """Save a permanent checkpoint when training ends (and a temporary one when it is stopped early)."""
    save_interval_steps: int | None = None
    """Also a temporary checkpoint every this many steps; null = none."""
    temporary_cooldown: timedelta | None = None
    """Least wall time between a save and the next temporary one (a temporary save due sooner is skipped); null = none."""
    fixed_steps: list[int] = field(default_factory=list)
    """Steps that get a permanent checkpoint whatever the other policies say; never deleted."""
    save_at_start: bool = False
    """Save a permanent checkpoint of the initial state (step 0) before the first step of a fresh run; never deleted."""
    keep_last: int | None = None
    """Keep only the newest N checkpoints of those `removal` may delete; null = temporary ones go once superseded."""
    removal: str = "ephemeral_only"
    """What may be deleted: ephemeral_only (temporary checkpoints), all_non_permanent (also keep-policy and end-of-training ones beyond keep_last), never."""
    async_save: bool = True
    """Write checkpoints on a background thread while training goes on; false = each save blocks until committed."""
    append_run_id_to_base_path: bool = False
    """Save under <base_path>/<run_id>, so runs that share a base_path never see each other's checkpoints."""

    def __post_init__(self):
        where = "trainer.checkpointer"
        if self.save_interval_steps is not None and self.save_interval_steps <= 0:
            raise ValueError(
                f"{where}.save_interval_steps must be > 0 or null, got {self.save_interval_steps}"
            )
        if self.temporary_cooldown is not None and self.temporary_cooldown.total_seconds() <= 0:
            raise ValueError(
                f"{where}.temporary_cooldown must be positive or null, got {self.temporary_cooldown}"
            )
        bad = [s for s in self.fixed_steps if s < 0]
        if bad:
            raise ValueError(f"{where}.fixed_steps must be steps >= 0, got {bad}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"{where}.keep_last must be >= 1 or null, got {self.keep_last}")
        if self.removal not in REMOVAL_STRATEGIES:
            raise ValueError(
                f"{where}.removal must be one of {list(REMOVAL_STRATEGIES)}, got {self.removal!r}"
            )
        if self.removal == "all_non_permanent" and self.keep_last is None:
            raise ValueError(
                f"{where}.removal all_non_permanent needs keep_last (how many checkpoints to keep)"
            )
        previous: int | None = -1
        for i, policy in enumerate(self.keep):
            where = f"trainer.checkpointer.keep[{i}]"
            if policy.every <= 0:
                raise ValueError(f"{where}.every must be > 0, got {policy.every}")
            if previous is None:
                raise ValueError(f"{where}: only the last keep policy may have until: null")
            if policy.until is not None and policy.until <= previous:
                raise ValueError(
                    f"{where}.until ({policy.until}) must be larger than the previous policy's until ({previous})"
                )
            previous = policy.until
        if self.save_interval is not None and self.save_interval.total_seconds() <= 0:
            raise ValueError(
                f"trainer.checkpointer.save_interval must be positive or null, got {self.save_interval}"
            )

    def is_pinned(self, step: int) -> bool:
        """Whether ``step`` is one of ``fixed_steps``: its checkpoint is never deleted."""
        return step in self.fixed_steps

    def is_permanent(self, step: int) -> bool:
        """Whether ``fixed_steps`` or the keep policies ask for a permanent checkpoint at ``step``."""
        if self.is_pinned(step):
            return True
        for policy in self.keep:
            if policy.until is None or step <= policy.until:
                return step % policy.every == 0
        return False
