"""Trainer options about the run around the step: uneven batches, an accelerator required,
power-off at exit, and model averaging as a trainer key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from loomax.config import ConfigError, parse_config
from loomax.hooks import EmaHook, default_hooks
from loomax.lm import TrainLmConfig
from loomax.train import TrainerConfig, setup_process
from loomax.train.averaging import EmaDecaySqrtAveraging
from loomax.train_lm import train_lm

HERE = Path(__file__).parent


def test_a_batch_that_does_not_divide_over_the_devices_trains_when_allowed(tmp_path):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    out = subprocess.run(
        [sys.executable, str(HERE / "uneven_batch_run.py"), str(tmp_path)],
        env={**os.environ, "XLA_FLAGS": flags},
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.splitlines()[-1])
    np.testing.assert_allclose(result["two"], result["one"], rtol=1e-5)  # as on one device
    assert "trainer.allow_nondivisible_batch_size" in result["error"]


def test_require_accelerator_fails_at_start_on_a_cpu_only_host(tiny, tmp_path):
    assert {d.platform for d in jax.devices()} == {"cpu"}
    with pytest.raises(
        ConfigError, match="trainer.require_accelerator is set but JAX found no GPU"
    ):
        setup_process(TrainerConfig(require_accelerator=True))
    with pytest.raises(ConfigError, match="trainer.require_accelerator"):
        tiny.trainer(tmp_path, require_accelerator=True)
    tiny.trainer(tmp_path)  # without it the CPU will do


def test_shutdown_at_exit_schedules_the_power_off_even_when_the_run_fails(tmp_path, monkeypatch):
    from loomax.train import shutdown

    record = tmp_path / "shutdown_args.json"
    writer = "import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))"
    monkeypatch.setattr(
        shutdown, "COMMAND", (sys.executable, "-c", writer, str(record), "+{minutes}")
    )
    config = parse_config(
        TrainLmConfig,
        None,
        [
            "--trainer.shutdown_at_exit", "90s",
            "--trainer.load_checkpoint", "true",  # fails at once: there is no checkpoint
            "--trainer.load_checkpoint_path", str(tmp_path / "nowhere"),
            "--trainer.run_dir", str(tmp_path / "run"),
        ],
    )  # fmt: skip
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        train_lm(config)
    assert json.loads(record.read_text()) == [str(record), "+2"]  # 90 s: in 2 minutes
    assert shutdown.COMMAND[-1] == "+{minutes}"
    with pytest.raises(ConfigError, match="shutdown_at_exit"):
        parse_config(TrainerConfig, None, ["--shutdown_at_exit=-5m"])


def test_model_averaging_is_a_trainer_key_over_the_ema_hook(tiny, tmp_path):
    config = parse_config(
        TrainerConfig,
        None,
        [
            "--model_averaging",
            '{"type": "ema_decay_sqrt", "beta": 0.5, "switch_step": 1, "decay_steps": 2}',
        ],
    )
    averaging = config.model_averaging
    assert averaging == EmaDecaySqrtAveraging(beta=0.5, switch_step=1, decay_steps=2)
    (ema,) = [c for c in default_hooks(config) if isinstance(c, EmaHook.Config)]
    assert ema.use_for_eval and ema.averaging == averaging

    trainer = tiny.trainer(tmp_path, steps=3)
    trainer.add_hook(ema.build(None))
    seen = []
    trainer.add_hook(lambda info: seen.append(embedding(info.state.model)))
    state = tiny.init(trainer)
    expected = embedding(state.model)
    final = trainer.train(state, tiny.batches())
    # decay after 0, 1, 2 steps done: beta, then the new weights' share 0.5 * (1 - sqrt(progress))
    for done, params in enumerate(seen):
        share = 0.5 * (1 - min(1.0, max(0.0, (done - 1) / 2)) ** 0.5)
        decay = 1 - max(share, 1e-5)
        expected = decay * expected + (1 - decay) * params
    got = np.asarray(jax.device_get(final.state.extras["ema"].token_embeddings.weight.array))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_array_equal(embedding(final.eval_model), got)  # evaluated, not the weights
    with pytest.raises(ConfigError, match="trainer.model_averaging: trainer.hooks has an ema"):
        parse_config(
            TrainerConfig,
            None,
            ["--model_averaging", '{"type": "ema"}', "--hooks", '[{"type": "ema"}]'],
        )


def embedding(model):
    return np.asarray(model.token_embeddings.weight.array)


def test_a_scratch_run_tracks_nothing_loads_nothing_and_saves_inside_its_folder(tmp_path):
    """`loomax compile` and `loomax bench` build their trainers from `for_scratch_run`."""
    from loomax.tracking import JsonlTrackerConfig, NoopTrackerConfig

    config = TrainerConfig(tracker=JsonlTrackerConfig(), load_checkpoint=True)
    scratch = config.for_scratch_run(str(tmp_path))
    assert isinstance(scratch.tracker, NoopTrackerConfig)
    assert (scratch.progress_bar, scratch.load_checkpoint) == (False, False)
    assert scratch.run_dir == str(tmp_path)
    assert scratch.checkpointer.base_path == f"{tmp_path}/checkpoints"
