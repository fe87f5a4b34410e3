"""Config saver: the resolved config YAML in the run dir and inside every checkpoint."""

from __future__ import annotations

from loomax.hooks import ConfigSaverHook


def test_config_in_run_dir_and_checkpoints(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=2)
    trainer.add_hook(ConfigSaverHook(config_yaml="model:\n  type: gpt2\n", run_dir=trainer.run_dir))
    assert (trainer.run_dir / "config.yaml").read_text() == "model:\n  type: gpt2\n"
    trainer.add_hook(lambda info: info.control.save() if info.step == 1 else None)
    trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    for step in (1, 2):
        saved = trainer.run_dir / "checkpoints" / f"step-{step}" / "config.yaml"
        assert saved.read_text() == "model:\n  type: gpt2\n"
