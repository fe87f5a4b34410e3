"""Weights & Biases: metrics, the resolved config, the launching commit and its diff.

The run id is kept in ``<run_dir>/wandb_run_id``, so a job that resumes from a
checkpoint in the same run directory continues the same wandb run; the last step logged
to it is kept in ``<run_dir>/wandb_last_step``, so a resumed job never logs a step the run
already has (wandb keeps a run's steps increasing and drops the others).
``WANDB_MODE=offline`` (or ``mode: offline``) writes everything under ``dir`` without
touching the network. An online run without credentials stops before any work
(``check_credentials``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomax.atomic_files import replace_text
from loomax.errors import UserError
from loomax.tracking.base import Tracker, TrackerConfig
from loomax.tracking.git import git_info
from loomax.tracking.optional import check_installed, require

logger = logging.getLogger(__name__)

ID_FILE = "wandb_run_id"
LAST_STEP_FILE = "wandb_last_step"
_MODES = ("online", "offline", "disabled", "shared")
_LOCAL_MODES = ("offline", "dryrun", "disabled")
_HOW_TO_FIX = (
    "set WANDB_API_KEY or run `wandb login`, or use mode: offline (WANDB_MODE=offline) "
    "to log locally"
)


class WandbCredentialsError(UserError, ValueError):
    """wandb would log online but has no usable credentials."""


@TrackerConfig.register_subclass("wandb")
@dataclass(frozen=True)
class WandbTrackerConfig(TrackerConfig):
    """Log to Weights & Biases (needs WANDB_API_KEY, or mode: offline)."""

    project: str | None = "loomax"
    """wandb project; null = WANDB_PROJECT."""
    entity: str | None = None
    """wandb team or user; null = WANDB_ENTITY or your default entity."""
    name: str | None = None
    """Display name of the run; null = trainer.run_id."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""
    id: str | None = None
    """wandb run id; null = the one stored in <run_dir>/wandb_run_id, else a new one (stored there)."""
    group: str | None = None
    """Group of related runs (e.g. a sweep or a ladder)."""
    notes: str | None = None
    """Free-text notes of the run."""
    mode: str | None = None
    """online, offline or disabled; null = WANDB_MODE, else online."""
    dir: str | None = None
    """Where wandb keeps its local files; null = WANDB_DIR, else the run directory."""
    save_git_diff: bool = True
    """Save the launching repository's uncommitted diff as git_diff.patch in the run's files."""

    def __post_init__(self):
        if self.mode is not None and self.mode not in _MODES:
            raise ValueError(
                f"trainer.tracker.mode must be one of {', '.join(_MODES)} or null, got {self.mode!r}"
            )

    def check_available(self) -> None:
        check_installed("wandb", extra="wandb", tracker="wandb")
        check_credentials(self.mode)

    def init(self, run_dir: Path) -> Tracker:
        return WandbTracker(self, Path(run_dir))


def resolve_run_id(config: WandbTrackerConfig, run_dir: Path) -> str:
    """The wandb id of this run: configured, stored in the run directory, or new (and stored)."""
    path = run_dir / ID_FILE
    stored = path.read_text().strip() if path.exists() else None
    run_id = config.id or stored or secrets.token_hex(4)
    if run_id != stored:
        run_dir.mkdir(parents=True, exist_ok=True)
        replace_text(path, run_id + "\n")  # a crash mid-write must not lose the id
    return run_id


def check_credentials(mode: str | None = None) -> None:
    """Raise ``WandbCredentialsError`` if wandb would log online but finds no API key.

    Online is ``mode``, else ``WANDB_MODE``, else wandb's own settings, unless offline or
    disabled. wandb itself looks for the key (``WANDB_API_KEY``, the netrc entry of
    ``wandb login``, its settings files, an identity token), without contacting a server.
    """
    wandb = require("wandb", extra="wandb", tracker="wandb")
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
    except ImportError:  # a wandb without these modules: wandb.init will say it
        return
    settings = wandb_setup.singleton().settings
    mode = mode or os.environ.get("WANDB_MODE") or settings.mode
    if mode in _LOCAL_MODES:
        return
    try:
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        auth = wbauth.authenticate_session(
            host=host, source="loomax", prompt=False, update_session=False
        )
    except (ValueError, wandb.errors.AuthenticationError) as e:
        raise WandbCredentialsError(
            f"trainer.tracker type: wandb (mode {mode}) cannot use its credentials: {e}; "
            + _HOW_TO_FIX
        ) from e
    if auth is None:
        raise WandbCredentialsError(
            f"trainer.tracker type: wandb logs online (mode {mode}) but wandb finds no API key "
            f"for {settings.base_url}: " + _HOW_TO_FIX
        )


class WandbTracker(Tracker):
    """One wandb run; resumed (same id) when the run directory already names one."""

    def __init__(self, config: WandbTrackerConfig, run_dir: Path):
        wandb = require("wandb", extra="wandb", tracker="wandb")
        self._wandb = wandb
        self.run_id = resolve_run_id(config, run_dir)
        directory = Path(config.dir or os.environ.get("WANDB_DIR") or run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        git = git_info()
        try:
            self.run = self._init(wandb, config, run_dir, directory, git)
        except wandb.errors.UsageError as e:
            raise WandbCredentialsError(
                f"trainer.tracker type: wandb could not start a run ({e}): " + _HOW_TO_FIX
            ) from e
        if config.save_git_diff and git.dirty:
            patch = Path(self.run.dir) / "git_diff.patch"
            patch.write_text(git.diff)
            self.run.save(str(patch), base_path=self.run.dir, policy="now")
        mode = self.run.settings.mode
        logger.info("wandb run %s (%s)", self.run_id, mode)
        self._step_file = run_dir / LAST_STEP_FILE if mode != "disabled" else None
        self._last_step = _stored_last_step(run_dir / LAST_STEP_FILE, self.run_id)
        self._first_step = max(self._last_step + 1, getattr(self.run, "starting_step", 0) or 0)
        """The first step this job may log: the run has the ones before (wandb drops those)."""
        self._told_skip = False

    def _init(self, wandb, config: WandbTrackerConfig, run_dir: Path, directory: Path, git):
        return wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name or run_dir.name,
            tags=list(config.tags) or None,
            id=self.run_id,
            group=config.group,
            notes=config.notes,
            mode=config.mode,
            dir=str(directory),
            resume="allow",
            config={"git": {"commit": git.commit, "dirty": git.dirty, "remote": git.remote}},
            settings=wandb.Settings(git_commit=git.commit or None),
        )

    def resume_from(self, step: int) -> None:
        if self._first_step > step + 1:
            logger.warning(
                "wandb run %s already has steps %d-%d, logged after the checkpoint at step %d "
                "by the interrupted attempt; wandb cannot replace them, so it keeps them and "
                "this run logs from step %d on",
                self.run_id,
                step + 1,
                self._first_step - 1,
                step,
                self._first_step,
            )

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        if step < self._first_step:  # the run already has it: wandb would drop it, with a warning
            if not self._told_skip:
                logger.info("wandb run %s already has step %d: not logged again", self.run_id, step)
                self._told_skip = True
            return
        self.run.log({k: _scalar(v) for k, v in metrics.items()}, step=step)
        if step > self._last_step and self._step_file is not None:
            self._last_step = step
            replace_text(self._step_file, json.dumps({"id": self.run_id, "step": step}) + "\n")

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self.run.config.update(_nested(hparams), allow_val_change=True)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for key, value in summary.items():
            self.run.summary[key] = _scalar(value)

    def log_artifact(self, path: Path, *, name: str, type: str = "artifact") -> None:
        artifact = self._wandb.Artifact(_artifact_name(name), type=type)
        if Path(path).is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path), name=Path(path).name)
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        self.run.finish()


def _stored_last_step(path: Path, run_id: str) -> int:
    """The last step logged to wandb run ``run_id`` from this run directory, or -1."""
    try:
        stored = json.loads(path.read_text())
        return int(stored["step"]) if stored["id"] == run_id else -1
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}`` (the config as it reads in YAML)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = str(key).split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[leaf] = value
    return out


def _scalar(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        return value.item()
    return value


def _artifact_name(name: str) -> str:
    """wandb artifact names allow letters, digits, '-', '_' and '.'."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
