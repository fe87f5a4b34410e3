"""Files replaced whole: a reader sees the old file or the complete new one, never a part."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from loomax.atomic_files import replace_file, replace_path, replace_text


def test_the_old_file_stays_until_the_new_one_is_complete(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("old")
    seen_while_writing = []

    def write(f):
        f.write("new, first half;")
        f.flush()
        seen_while_writing.append(path.read_text())
        f.write(" second half")

    replace_file(path, write)
    assert seen_while_writing == ["old"]
    assert path.read_text() == "new, first half; second half"
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("old")

    def write_to(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_path(path, write_to)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["model.yaml"]


def test_a_temp_left_by_a_killed_writer_with_the_same_pid_does_not_block(tmp_path):
    # in a container a restarted job often has the same pid and main-thread id as before
    path = tmp_path / "metrics.json"
    stale = tmp_path / f".metrics.json.tmp-{os.getpid()}-{threading.get_ident()}"
    stale.write_text("half")
    replace_text(path, "{}")
    assert path.read_text() == "{}"


def test_a_new_file_appears_only_whole_and_with_the_mode_asked_for(tmp_path):
    path = tmp_path / "control.json"
    seen = []
    replace_file(path, lambda f: seen.append(path.exists()) or f.write("{}"), mode=0o600)
    assert seen == [False] and path.read_text() == "{}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    replace_text(path, "[]")  # replacing keeps nothing of the old file, mode included
    assert path.read_text() == "[]"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
