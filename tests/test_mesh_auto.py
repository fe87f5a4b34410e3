"""``trainer.mesh.auto`` and ``trainer.force_strategy``: the mesh chosen when ``loomax train`` starts."""

from __future__ import annotations

import pytest

from loomax.config import ConfigError, parse_config
from loomax.lm.config import TrainLmConfig
from loomax.plan import auto
from loomax.plan.topology import get_topology

TINY = [
    "--model.type", "gpt2", "--model.hidden_dim", "32", "--model.num_heads", "2",
    "--model.seq_len", "16", "--model.num_layers", "1", "--model.vocab_size", "64",
    "--trainer.train_batch_size", "2",
]  # fmt: skip


def config(*extra: str) -> TrainLmConfig:
    return parse_config(TrainLmConfig, None, [*TINY, *extra])


def test_a_trainer_refuses_an_auto_mesh_left_unchosen():
    mesh = config("--trainer.mesh.auto", "true").trainer.mesh
    assert mesh.auto and not config().trainer.mesh.auto
    with pytest.raises(
        ConfigError, match="trainer.mesh.auto: the mesh is chosen by `loomax train`"
    ):
        mesh.resolve(8)


def test_the_fastest_strategy_is_chosen_said_why_and_cached(tmp_path, monkeypatch):
    said: list[str] = []
    chosen = auto.choose_strategy(
        config("--trainer.mesh.auto", "true"), cache=tmp_path, say=said.append
    )
    assert not chosen.trainer.mesh.auto and chosen.trainer.mesh.resolve(1) == {
        "replica": 1, "data": 1, "expert": 1, "context": 1, "model": 1, "stage": 1,
    }  # fmt: skip
    assert len(said) == 1 and said[0].startswith("trainer.mesh.auto: ")
    assert "est. step" in said[0] and "next " in said[0]  # the winner, and the runner-up
    assert len(list(tmp_path.glob("*.json"))) == 1

    def no_compiles(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(auto, "compile_all", no_compiles)
    again = auto.choose_strategy(
        config("--trainer.mesh.auto", "true"), cache=tmp_path, say=said.append
    )
    assert again == chosen and "chosen before" in said[1]
    other = config(
        "--trainer.mesh.auto", "true", "--model.hidden_dim", "64"
    )  # another config: searched
    with pytest.raises(AssertionError, match="compiled again"):
        auto.choose_strategy(other, cache=tmp_path, say=said.append)


def test_force_strategy_names_one_without_compiling(monkeypatch, libtpu):
    monkeypatch.setattr(auto, "compile_all", None)
    topology = get_topology("v5e:2x2")
    said: list[str] = []
    forced = config("--trainer.force_strategy", "zero2 tp2 2x2")
    chosen = auto.choose_strategy(forced, topology=topology, say=said.append)
    assert chosen.trainer.mesh.resolve(4) == {
        "replica": 1,
        "data": 2,
        "expert": 1,
        "context": 1,
        "model": 2,
        "stage": 1,
    }
    assert chosen.trainer.shard_params is False and chosen.trainer.force_strategy is None
    assert said[0].startswith("trainer.force_strategy: zero2 tp2 2x2 (trainer.mesh=")
    with pytest.raises(ConfigError, match="trainer.force_strategy: unknown strategy 'fastest'"):
        auto.choose_strategy(config("--trainer.force_strategy", "fastest"), topology=topology)


def test_without_auto_the_config_is_untouched():
    plain = config()
    assert auto.choose_strategy(plain, say=None) is plain
