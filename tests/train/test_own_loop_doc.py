"""docs/own_loop.md: its code trains, checkpoints and reloads without a Trainer."""

from __future__ import annotations

import re


def test_the_bring_your_own_loop_page_runs(repo_root, tmp_path, monkeypatch, capsys):
    page = (repo_root / "docs" / "own_loop.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", page, re.S))
    assert "make_train_step" in code and "Checkpointer" in code and "training_steps" in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/own_loop.md", "exec"), {"__name__": "own_loop"})
    assert (tmp_path / "own_loop" / "checkpoints" / "step-4" / "metadata.json").exists()
    assert (tmp_path / "own_loop" / "run" / "checkpoints" / "step-3" / "metadata.json").exists()
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["1", "2", "3", "4", "2", "4"]
