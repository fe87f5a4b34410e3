"""The model ladder: sizes and shapes, Chinchilla plans, and three tiny sizes end to end on CPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from loomax.cli import main
from loomax.config import parse_config
from loomax.ladder import (
    ChinchillaRunConfigurator,
    LadderConfig,
    checkpoints_table,
    fit_power_law,
    metrics_table,
    parse_size,
    rung,
    shape_for,
)
from loomax.ladder.command import rungs_of


def test_sizes_and_shapes():
    assert parse_size("30M") == 30_000_000 and parse_size("1.5B") == 1_500_000_000
    assert parse_size("500k") == 500_000
    with pytest.raises(ValueError, match="ladder size"):
        parse_size("30 parameters")
    shape = shape_for(30_000_000)
    assert 0.8 < shape.non_embedding_params() / 30e6 < 1.25
    assert shape.hidden_dim % 64 == 0 and shape.hidden_dim // shape.num_heads == 64
    assert shape_for(150_000_000).num_layers > shape.num_layers


def test_chinchilla_plan_by_hand():
    run = ChinchillaRunConfigurator(
        chinchilla_multiple=2, tokens_per_param=20, batch_size_tokens=1024, learning_rate=1e-3
    )
    # the budget counts the 1,000 non-embedding parameters, not the 1,500 in all
    plan = run.plan(params=1500, seq_len=32, non_embedding_params=1000)
    assert plan.batch_size == 32 and plan.tokens == 40_000 + 960  # 40,000 rounded up to whole steps
    assert plan.num_train_steps == 40 and plan.budget_params == 1000 and plan.params == 1500
    # checkpoints at 0.5x, 1x and 2x the Chinchilla budget of 20,000 tokens, named so
    assert plan.checkpoint_steps == [10, 20, 40] and plan.cycles == [10, 20, 40]
    assert plan.checkpoint_names == ["0.5xC", "1xC", "2xC"] and plan.checkpoint_name(20) == "1xC"
    assert plan.flops == 6 * 1000 * 40 * 1024 and plan.cycle_peaks is None
    total = ChinchillaRunConfigurator(budget_params="total", batch_size_tokens=1024)
    assert total.plan(1500, 32, 1000).budget_params == 1500
    cosine = ChinchillaRunConfigurator(wsd_s=False, batch_size_tokens=1024)
    assert cosine.plan(1000, 32, 1000).cycles is None
    with pytest.raises(ValueError, match="ladder.run.decay_fraction"):
        ChinchillaRunConfigurator(decay_fraction=1.5)
    with pytest.raises(ValueError, match="stepped_schedule was renamed ladder.run.wsd_s"):
        ChinchillaRunConfigurator(stepped_schedule=True)


def test_stepped_peak_lr_lowers_each_stage_by_one_over_sqrt_of_its_data():
    run = ChinchillaRunConfigurator(
        chinchilla_multiple=2, batch_size_tokens=1024, learning_rate=1e-3, stepped_peak_lr=True
    )
    plan = run.plan(1000, 32, 1000)  # stages end at 10, 20 and 40 steps
    assert plan.cycle_peaks == pytest.approx([1.0, (10 / 20) ** 0.5, (10 / 40) ** 0.5])
    ladder = LadderConfig(sizes=["10M"], run=run)
    r = rung(ladder, "10M")
    schedule = r.config.optimizer.lr_scheduler(r.plan.num_train_steps)
    stable = [p.lr_start for p in schedule.phases() if p.kind == "stable"]
    peak = r.plan.learning_rate
    assert stable == pytest.approx([peak * m for m in r.plan.cycle_peaks])
    with pytest.raises(ValueError, match="stepped_peak_lr needs ladder.run.wsd_s"):
        ChinchillaRunConfigurator(stepped_peak_lr=True, wsd_s=False)


def test_rungs_log_to_one_tracker_project():
    from loomax.config import ConfigError
    from loomax.lm import TrainLmConfig
    from loomax.tracking import JsonlTrackerConfig
    from loomax.tracking.wandb import WandbTrackerConfig

    base = TrainLmConfig()
    base = replace(
        base,
        trainer=replace(base.trainer, tracker=[JsonlTrackerConfig(), WandbTrackerConfig()]),
    )
    ladder = LadderConfig(sizes=["10M"], name="lad", project="scaling")
    jsonl, wandb = rung(ladder, "10M", base=base).config.trainer.tracker
    assert wandb.project == "scaling" and wandb.group == "lad" and jsonl == JsonlTrackerConfig()
    with pytest.raises(ConfigError, match="ladder.project: no tracker"):
        rung(ladder, "10M")  # the default base logs to jsonl only


def test_rung_run_config_is_wsd_s_with_checkpoints_at_each_decay():
    ladder = LadderConfig(sizes=["10M", "30M"])
    r = rung(ladder, "30M", devices=8)
    optimizer, trainer = r.config.optimizer, r.config.trainer
    assert optimizer.cycles == r.plan.checkpoint_steps and optimizer.lr_schedule == "linear"
    assert [p.kind for p in optimizer.lr_scheduler(trainer.num_train_steps).phases()] == [
        "warmup",
        "stable",
        "linear",
        "stable",
        "linear",
    ]
    for step in r.plan.checkpoint_steps:
        assert trainer.checkpointer.is_permanent(step)
    assert not trainer.checkpointer.is_permanent(r.plan.checkpoint_steps[0] + 1)
    assert trainer.run_dir.endswith("ladder-30M")
    with pytest.raises(ValueError, match="ladder.sizes"):
        rung(ladder, "60M")


def test_fit_power_law_recovers_exponent():
    compute = [1e10, 1e11, 1e12]
    a, b = fit_power_law(compute, [5 * c**-0.05 for c in compute])
    assert a == pytest.approx(5) and b == pytest.approx(0.05)


@pytest.fixture(scope="module")
def tiny_ladder(tmp_path_factory, tiny_corpus) -> Path:
    root = tmp_path_factory.mktemp("ladder")
    base = {
        "data": {
            "train": [{"urls": [str(tiny_corpus)]}],
            "tokenizer_vocab_size": 300,
            "validation_fraction": 0.1,
            "cache_dir": str(root / "cache"),
        },
        "trainer": {
            "progress_bar": False,
            "log_every": 5,
            "steps_per_eval": 1000,
            "max_eval_batches": 2,
            "eval_at_start": False,
        },
        "sample": {"enabled": False},
    }
    (root / "base.yaml").write_text(json.dumps(base))
    ladder = {
        "name": "tiny",
        "sizes": ["20K", "50K", "100K"],
        "base_config": "base.yaml",
        "run_root": str(root / "runs"),
        "model": {"type": "gpt2", "seq_len": 32, "aspect_ratio": 16, "head_dim": 16},
        "run": {
            "type": "chinchilla",
            "tokens_per_param": 0.25,  # 13, 19 and 42 steps of batches of 16 rows
            "batch_size_tokens": 512,
            "learning_rate": 0.01,
            "decay_fraction": 0.2,
        },
    }
    (root / "ladder.yaml").write_text(json.dumps(ladder))
    return root / "ladder.yaml"


def test_dry_run_prints_the_plan_and_plots(tiny_ladder, tmp_path, capsys):
    out = tmp_path / "lr.png"
    main(
        ["ladder", "dry-run", "--config_path", str(tiny_ladder), "--size", "50K", "--out", str(out)]
    )
    text = capsys.readouterr().out
    for word in ("parameters", "batch size", "duration", "minimal mesh", "checkpoints", "linear"):
        assert word in text
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_benchmark_times_one_size_and_stops(tiny_ladder, capsys):
    main(
        ["ladder", "benchmark", "--config_path", str(tiny_ladder), "--size", "20K", "--steps", "2"]
    )
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tokens_per_second"] > 0 and "size 20K" in out and "1xC" in out
    assert not (tiny_ladder.parent / "runs" / "tiny-20K").exists()  # no run dir, no checkpoints
    with pytest.raises(SystemExit):
        main(["ladder", "benchmark", "--config_path", str(tiny_ladder)])
    assert "needs --size" in capsys.readouterr().err


def test_bad_size_is_named(tiny_ladder, capsys):
    with pytest.raises(SystemExit):
        main(["ladder", "dry-run", "--config_path", str(tiny_ladder), "--size", "7M"])
    assert "--size 7M is not one of ladder.sizes" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_three_tiny_sizes_end_to_end(tiny_ladder, capsys):
    main(["ladder", "run", "--config_path", str(tiny_ladder)])
    capsys.readouterr()
    plot = tiny_ladder.parent / "loss.png"
    main(["ladder", "results", "--config_path", str(tiny_ladder), "--out", str(plot)])
    text = capsys.readouterr().out
    assert "power law: loss =" in text and plot.read_bytes()[:4] == b"\x89PNG"

    ladder = parse_config(LadderConfig, str(tiny_ladder), [])
    rungs = rungs_of(ladder, str(tiny_ladder))
    checkpoints = checkpoints_table(rungs)
    assert checkpoints["exists"].all() and set(checkpoints["size"]) == {"20K", "50K", "100K"}
    assert (checkpoints.groupby("size").size() == 2).all()  # 0.5x and 1x Chinchilla
    assert list(checkpoints["name"].unique()) == ["0.5xC", "1xC"] and checkpoints["planned"].all()

    metrics = metrics_table(rungs)
    finals = metrics.dropna(subset=["eval/loss"]).groupby("size")["eval/loss"].last()
    assert set(finals.index) == {"20K", "50K", "100K"}
    assert (
        metrics.groupby("size")["flops"].max().sort_values().index == ["20K", "50K", "100K"]
    ).all()

    # a copy elsewhere (moved off the training machine) with one more checkpoint in it
    import shutil

    moved = tiny_ladder.parent / "archive"
    moved.mkdir()
    shutil.move(str(rungs[0].run_dir), moved / rungs[0].run_dir.name)
    last = max(rungs[0].plan.checkpoint_steps)
    extra = moved / rungs[0].run_dir.name / "checkpoints"
    shutil.copytree(extra / f"step-{last}", extra / f"step-{last + 1}")
    meta = json.loads((extra / f"step-{last + 1}" / "metadata.json").read_text())
    (extra / f"step-{last + 1}" / "metadata.json").write_text(
        json.dumps({**meta, "step": last + 1})
    )
    assert not checkpoints_table(rungs)["exists"].head(2).any()  # not in run_root any more
    found = checkpoints_table(rungs, [moved])
    first = found[found["size"] == "20K"]
    assert first["exists"].all() and list(first["planned"]) == [True, True, False]
    assert first["path"].iloc[-1].endswith(f"step-{last + 1}") and first["name"].iloc[-1] == ""
    assert set(metrics_table(rungs, [moved])["size"]) == {"20K", "50K", "100K"}


def test_llama_configurator_builds_a_llama():
    from loomax.ladder import LlamaConfigurator

    ladder = LadderConfig(sizes=["10M"], model=LlamaConfigurator(seq_len=256))
    r = rung(ladder, "10M")
    assert type(r.config.model).__name__ == "LlamaConfig"
    assert r.config.model.intermediate_dim % 64 == 0 and r.config.model.seq_len == 256
    assert r.plan.params > 10_000_000  # embeddings come on top of the 10M
