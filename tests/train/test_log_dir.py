"""trainer.log_dir: a real run's Python log also lands in a file of its process."""

from __future__ import annotations

import logging

import pytest

from loomax.hooks import ConsoleHook
from loomax.train import setup_process


@pytest.fixture
def restored_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


@pytest.mark.usefixtures("restored_root_logger")
def test_the_run_log_is_written_to_a_file_per_process(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=3, run_id="r7", log_dir=str(tmp_path / "logs"))
    assert setup_process(trainer.config) == "r7"
    setup_process(trainer.config)  # again: still one file handler, lines written once
    trainer.add_hook(ConsoleHook(every=1, total_steps=3, tokens_per_step=64))
    trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    (path,) = (tmp_path / "logs").iterdir()
    assert path.name == "r7.process-0.log"
    lines = path.read_text().splitlines()
    console = [line for line in lines if " INFO loomax.console: step " in line]
    assert [line.split(": ", 1)[1].split(" | ")[0] for line in console] == ["step 1/3", "step 2/3"]
