"""A run's own hooks are registry configs, built exactly like the ones listed in trainer.hooks."""

from __future__ import annotations

from dataclasses import dataclass

from loomax.config import parse_config
from loomax.hooks import (
    ConfigSaverHook,
    EvalHook,
    LogMetricsHook,
    NanCheckHook,
    ProgressBarHook,
    SpeedMonitorHook,
    default_hooks,
)
from loomax.train import Hook, HookConfig, HookContext, TrainerConfig, hook_type


@hook_type("test_defaults_probe")
class Probe(Hook):
    """A user hook type."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        every: int = 7
        """Run every this many steps."""


def test_defaults_and_yaml_hooks_come_from_one_registry(tmp_path):
    path = tmp_path / "trainer.yaml"
    path.write_text(
        "log_every: 5\nsteps_per_eval: 20\nhooks:\n"
        "  - {type: test_defaults_probe}\n  - {type: speed, every: 3}\n"
    )
    config = parse_config(TrainerConfig, path)
    configs = default_hooks(config) + list(config.hooks)
    known = HookConfig.get_known_choices()
    assert all(known[c.type_name()] is type(c) for c in configs)
    run_eval = lambda model: {"eval/loss": 1.0}  # noqa: E731
    context = HookContext(
        runtime=None,
        trainer_config=config,
        run_dir=tmp_path / "run",
        evaluator=run_eval,
        tokens_per_step=64,
        config_yaml="trainer: {}\n",
    )
    built = [c.build(context) for c in configs]
    assert [type(h) for h in built] == [
        ConfigSaverHook,
        ProgressBarHook,
        NanCheckHook,
        EvalHook,
        LogMetricsHook,
        SpeedMonitorHook,
        Probe,
        SpeedMonitorHook,
    ]
    evaluator = built[3]
    assert evaluator.evaluate is run_eval and evaluator.name == "EvalHook"  # the run's, shared
    assert evaluator.every == 20 and evaluator.config.at_start
    assert evaluator.config.max_batches == config.max_eval_batches
    assert built[4].every == 5 and built[5].config.every == 5 and built[7].config.every == 3
    assert built[6].every == 7
    assert (tmp_path / "run" / "config.yaml").read_text() == "trainer: {}\n"


def test_trainer_switches_leave_out_their_hooks():
    quiet = default_hooks(TrainerConfig(progress_bar=False, crash_on_nan=False))
    assert [c.type_name() for c in quiet] == ["config_saver", "eval", "log_metrics", "speed"]
    assert not any(isinstance(c, ProgressBarHook.Config | NanCheckHook.Config) for c in quiet)


def test_an_extra_eval_shares_the_evaluator_under_its_own_state_key():
    trainer = TrainerConfig(steps_per_eval=20)
    context = HookContext(runtime=None, trainer_config=trainer, evaluator=lambda model: {})
    extra = EvalHook.Config(every=5).build(context)
    assert extra.name == "EvalHook[every=5]" and extra.evaluate is context.evaluator
    assert EvalHook.Config.of_run(trainer).build(context).name == "EvalHook"
