"""The commit and uncommitted changes of the repository a run was launched from."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

COMMIT_ENV = "LOOMAX_GIT_COMMIT"
"""Set by ``loomax launch`` so that a run on a pod (or in a container) names the launching commit."""


@dataclass(frozen=True)
class GitInfo:
    """Where the code of a run came from."""

    commit: str | None
    dirty: bool
    diff: str
    remote: str | None


def git_info(path: str | Path = ".") -> GitInfo:
    """The HEAD commit, whether the tree is dirty, its diff against HEAD, and the origin URL.

    ``LOOMAX_GIT_COMMIT`` (set by ``loomax launch``) wins over the local checkout's HEAD;
    outside a git repository everything is empty.
    """
    commit = _git(path, "rev-parse", "HEAD")
    diff = _git(path, "diff", "HEAD", "--no-color") or ""
    launched = os.environ.get(COMMIT_ENV)
    if launched and launched != commit:
        return GitInfo(launched, False, "", _git(path, "remote", "get-url", "origin"))
    return GitInfo(commit, bool(diff.strip()), diff, _git(path, "remote", "get-url", "origin"))


def _git(path: str | Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=path, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if args[0] != "diff" else out.stdout
