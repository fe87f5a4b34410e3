"""The hook system: priority, control requests (stop/save/eval, who asked), lifecycle, pre_log, state round trip."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import jax
import numpy as np
import pytest

from loomax.config import ConfigError, parse_config
from loomax.hooks import EmaHook, LogMetricsHook
from loomax.train import Hook, HookConfig, HookContext, TrainerConfig, hook_type


def records(tmp_path):
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_priority_then_registration_order(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=1)
    order = []

    class Named(Hook):
        def __init__(self, label, priority):
            self.label, self.priority = label, priority

        def on_step(self, info):
            order.append(self.label)

    for label, priority in [("a", 0), ("b", 5), ("c", 0), ("d", -1), ("e", 5)]:
        trainer.add_hook(Named(label, priority))
    trainer.add_hook(lambda info: order.append("fn"), priority=3)
    trainer.train(tiny.init(trainer), tiny.batches())
    assert order == ["b", "e", "fn", "a", "c", "d"]


def test_control_eval_save_stop_with_who_asked(tiny, tmp_path, caplog):
    trainer = tiny.trainer(tmp_path, steps=10)
    trainer.config.checkpointer  # noqa: B018 - default policies: nothing due in 10 steps
    seen = {"eval": [], "save": [], "end": []}

    class Evaluator(Hook):
        def run_eval(self, info):
            return {"eval/loss": 1.5}

        def on_eval(self, info, results):
            seen["eval"].append((info.step, results["eval/loss"]))

    class Asker(Hook):
        def on_step(self, info):
            if info.step == 2:
                info.control.eval()
            if info.step == 3:
                info.control.save()
            if info.step == 4:
                info.control.stop("enough")

        def on_save(self, info, path):
            seen["save"].append((info.step, path))

        def on_train_end(self, info):
            seen["end"].append(info.step)

    trainer.add_hook(Evaluator())
    trainer.add_hook(Asker())
    trainer.add_hook(LogMetricsHook(every=100, tokens_per_step=64))
    with caplog.at_level(logging.INFO):
        final = trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    assert final.step == 4 and seen["end"] == [4]
    assert trainer.stop_reason == "enough (requested by Asker)"
    assert "stop requested by Asker" in caplog.text
    assert seen["eval"] == [(2, 1.5)]
    assert [s for s, _ in seen["save"]] == [3, 4]  # the request, then the end of training
    assert seen["save"][0][1].endswith("step-3")
    assert (tmp_path / "run" / "checkpoints" / "step-3" / "metadata.json").exists()
    logged = records(tmp_path)
    assert logged[2]["eval/loss"] == 1.5 and "train/loss" in logged[2]  # merged into one record


def test_pre_log_adds_changes_and_drops(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=2)

    class Edit(Hook):
        def pre_log(self, info, record):
            record["custom/double_loss"] = 2 * record["train/loss"]
            record.pop("optim/grad_norm")

    trainer.add_hook(LogMetricsHook(every=1, tokens_per_step=64))
    trainer.add_hook(Edit())
    trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    for r in records(tmp_path).values():
        assert r["custom/double_loss"] == pytest.approx(2 * r["train/loss"])
        assert "optim/grad_norm" not in r


def test_on_error_sees_the_error_and_it_propagates(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=5)
    errors = []

    class Boom(Hook):
        def on_step(self, info):
            if info.step == 2:
                raise KeyError("boom")

        def on_error(self, info, error):
            errors.append((info.step, repr(error)))

    trainer.add_hook(Boom())
    with pytest.raises(KeyError, match="boom"):
        trainer.train(tiny.init(trainer), tiny.batches())
    assert errors == [(2, "KeyError('boom')")]


class Counter(Hook):
    def __init__(self):
        self.count = 0

    def on_step(self, info):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_hook_state_and_state_extras_survive_a_checkpoint_round_trip(tiny, tmp_path):
    first = tiny.trainer(tmp_path, steps=3)
    first.add_hook(EmaHook(decay=0.5))
    counter = Counter()
    first.add_hook(counter)
    final = first.train(tiny.init(first), tiny.batches())
    saved_ema = jax.tree.map(np.asarray, jax.device_get(final.state.extras["ema"]))
    first.finish()

    second = tiny.trainer(tmp_path, steps=3)
    second.add_hook(EmaHook(decay=0.5))
    restored = Counter()
    second.add_hook(restored)
    state = tiny.init(second)
    assert int(state.step) == 3
    jax.tree.map(np.testing.assert_array_equal, saved_ema, jax.device_get(state.extras["ema"]))
    second.train(state, tiny.batches())  # nothing left to do, but hook states load
    assert restored.count == 3


def test_hooks_that_change_the_step_come_before_the_state(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=1)
    tiny.init(trainer)
    with pytest.raises(RuntimeError, match="before initial_state"):
        trainer.add_hook(EmaHook(decay=0.9))


@hook_type("test_counter")
class CountFrom(Counter):
    """A user hook type, declared the way users declare theirs: one class, one Config."""

    @dataclass(frozen=True)
    class Config(HookConfig):
        start: int = 0
        """Initial count."""

        def __post_init__(self):
            self.check(self.start >= 0, f"start must be >= 0, got {self.start}")

    def __init__(self, config=None, /, **settings):
        Hook.__init__(self, config, **settings)
        self.count = self.config.start


def test_user_hook_types_parse_from_yaml_and_bad_settings_name_the_key(tmp_path):
    import loomax.hooks  # noqa: F401 - registers the built-in types

    path = tmp_path / "trainer.yaml"
    path.write_text(
        "hooks:\n  - {type: test_counter, start: 5}\n  - {type: divergence, patience: 2}\n"
    )
    config = parse_config(TrainerConfig, path)
    assert isinstance(config.hooks[0], CountFrom.Config) and config.hooks[0].start == 5
    assert config.hooks[1].patience == 2
    assert config.hooks[0].build(HookContext(runtime=None)).count == 5
    assert CountFrom(start=2).count == 2  # the same settings from Python, validated once
    with pytest.raises(ValueError, match=r"trainer.hooks \(test_counter\): start must be >= 0"):
        CountFrom(start=-1)
    path.write_text("hooks:\n  - {type: test_counter, start: -1}\n")
    with pytest.raises(ConfigError, match="start must be >= 0"):
        parse_config(TrainerConfig, path)
    path.write_text("hooks:\n  - {type: divergence, action: explode}\n")
    with pytest.raises(ConfigError, match="action must be one of"):
        parse_config(TrainerConfig, path)
    path.write_text("hooks:\n  - {type: no_such_hook}\n")
    with pytest.raises(ConfigError, match="no_such_hook"):
        parse_config(TrainerConfig, path)


def _types_with_every() -> list[str]:
    import dataclasses

    import loomax.hooks  # noqa: F401 - registers the built-in types

    return sorted(
        name
        for name, cls in HookConfig.get_known_choices().items()
        if cls.__module__.startswith("loomax.")
        and "every" in {f.name for f in dataclasses.fields(cls)}
    )


@pytest.mark.parametrize("kind", _types_with_every())
def test_every_interval_must_be_positive_at_parse_time(tmp_path, kind):
    path = tmp_path / "trainer.yaml"
    path.write_text(f"hooks:\n  - {{type: {kind}, every: 0}}\n")
    with pytest.raises(ConfigError, match=rf"\({kind}\): every must be > 0, got 0"):
        parse_config(TrainerConfig, path)


def test_removed_skip_bad_steps_hook_says_how_to_migrate(tmp_path):
    import loomax.hooks  # noqa: F401 - registers the built-in types

    path = tmp_path / "trainer.yaml"
    path.write_text("hooks:\n  - {type: skip_bad_steps, window: 50, k: 4.0}\n")
    with pytest.raises(
        ConfigError,
        match=r"optimizer.skip_bad_steps: \{rolling_interval_length: 50, sigma_factor: 4.0",
    ):
        parse_config(TrainerConfig, path)
