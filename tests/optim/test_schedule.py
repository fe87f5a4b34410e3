"""Learning-rate schedules checked at phase boundaries against hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from loomax.config import ConfigError, parse_config
from loomax.lm import TrainLmConfig
from loomax.optim import AdamConfig, LrSchedule
from loomax.optim.schedule import cycle_ends, steps_of, warmup_then_decay


def values(kind, steps=110, warmup=10, ratio=0.1, peak=1.0, at=(0, 4, 9, 10, 60, 110, 200)):
    schedule = warmup_then_decay(kind, peak, steps, warmup, ratio)
    return [float(schedule(s)) for s in at]


def test_warmup_is_linear_to_peak():
    for kind in ("constant", "linear", "cosine", "inv_sqrt", "inv"):
        v = values(kind)
        assert v[:3] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine_by_hand():
    v = values("cosine")
    assert v[3] == pytest.approx(1.0)
    assert v[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert v[5] == pytest.approx(0.1) and v[6] == pytest.approx(0.1)


def test_linear_and_constant_by_hand():
    lin = values("linear")
    assert lin[4] == pytest.approx(1.0 - 0.9 * 0.5) and lin[5] == pytest.approx(0.1)
    assert values("constant")[3:] == pytest.approx([1.0] * 4)


def test_inv_sqrt_and_inv_by_hand():
    # timescale defaults to the warmup (10): lr = peak * sqrt(10 / (10 + d)), d = steps after warmup
    s = values("inv_sqrt", ratio=0.0, at=(10, 20, 50, 100))
    assert s == pytest.approx([1.0, math.sqrt(10 / 20), math.sqrt(10 / 50), math.sqrt(10 / 100)])
    i = values("inv", ratio=0.0, at=(10, 20, 50))
    assert i == pytest.approx([1.0, 0.5, 0.2])
    floored = LrSchedule("inv", 1.0, 100, 10, 0.3, timescale=5)
    assert float(floored(15)) == pytest.approx(0.5) and float(floored(90)) == pytest.approx(0.3)


def test_warmup_stable_decay():
    # 100 steps: warmup 10, stable 10..79, linear decay over the last 20 to 0.1
    s = LrSchedule("linear", 2.0, 100, 10, 0.1, decay=0.2)
    assert float(s(9)) == pytest.approx(2.0)
    assert float(s(79)) == pytest.approx(2.0)
    assert float(s(80)) == pytest.approx(2.0)
    assert float(s(90)) == pytest.approx(2.0 + (0.2 - 2.0) * 0.5)
    assert float(s(100)) == pytest.approx(0.2)
    assert [(p.kind, p.start, p.end) for p in s.phases()] == [
        ("warmup", 0, 10),
        ("stable", 10, 80),
        ("linear", 80, 100),
    ]


def test_cycles_with_rewarmup():
    # 2 cycles of 50: first warms 10 steps from 0, second re-warms 5 steps from the floor
    s = LrSchedule("cosine", 1.0, 100, 10, 0.2, cycles=2, rewarmup=5)
    assert float(s(49)) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 39 / 40)))
    assert float(s(50)) == pytest.approx(0.2 + 0.8 * 1 / 5)  # rewarmup step 1 of 5 from 0.2
    assert float(s(54)) == pytest.approx(1.0)
    assert float(s(75)) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 20 / 45)))
    assert float(s(100)) == pytest.approx(0.2)
    kinds = [(p.cycle, p.kind, p.start, p.end) for p in s.phases()]
    assert kinds == [
        (0, "warmup", 0, 10),
        (0, "cosine", 10, 50),
        (1, "warmup", 50, 55),
        (1, "cosine", 55, 100),
    ]


def test_wsd_s_decays_before_each_listed_cycle_end_and_jumps_back():
    s = LrSchedule("linear", 1.0, 100, 5, 0.0, decay=10, cycles=[30, 60])
    assert [c.end for c in s.cycles] == [30, 60, 100]
    assert float(s(19)) == pytest.approx(1.0)
    assert float(s(25)) == pytest.approx(0.5)  # halfway through the decay 20..30
    assert float(s(30)) == pytest.approx(1.0)  # next cycle: back at the peak, no rewarmup
    assert float(s(55)) == pytest.approx(0.5)
    assert float(s(95)) == pytest.approx(0.5) and float(s(100)) == pytest.approx(0.0)


def test_cycle_length_forms():
    assert cycle_ends(100, cycle_length=25) == [25, 50, 75, 100]
    assert cycle_ends(100, cycle_length=0.3) == [30, 60, 90, 100]
    assert cycle_ends(100, cycle_length=[20, 30]) == [20, 50, 100]
    assert cycle_ends(100, cycles=4) == [25, 50, 75, 100]
    assert cycle_ends(100) == [100]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cycles=2, cycle_length=10), "not both"),
        (dict(cycles=[50, 40]), "optimizer.cycles"),
        (dict(cycle_length=[80, 80]), "optimizer.cycle_length"),
        (dict(decay=0.95), "optimizer.decay"),
        (dict(warmup=2.5), "optimizer.warmup"),
    ],
)
def test_bad_cycles(kwargs, match):
    args = {"warmup": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        LrSchedule("linear", 1.0, 100, args.pop("warmup"), 0.0, **args)


def test_config_rejects_cycles_and_cycle_length():
    with pytest.raises(ValueError, match="optimizer.cycles and optimizer.cycle_length"):
        AdamConfig(cycles=2, cycle_length=10)


def test_warmup_as_fraction():
    assert (
        steps_of(0.1, 200, "w") == 20
        and steps_of(0, 200, "w") == 0
        and steps_of(30, 200, "w") == 30
    )
    with pytest.raises(ValueError, match="optimizer.warmup"):
        steps_of(2.5, 200, "optimizer.warmup")
    schedule = warmup_then_decay("cosine", 2.0, 100, 0.0, 0.0)
    assert float(schedule(0)) == pytest.approx(2.0) and float(schedule(100)) == pytest.approx(0.0)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="lr_schedule"):
        warmup_then_decay("exp", 1.0, 10, 0, 0)


def test_wsd_s_preset_parses(repo_root: Path, tmp_path: Path):
    run = tmp_path / "run.yaml"
    preset = repo_root / "config" / "optimizer" / "wsd_s.yaml"
    run.write_text(f"optimizer: !include {preset}\n")
    config = parse_config(TrainLmConfig, str(run), ["--trainer.num_train_steps", "1000"])
    schedule = config.optimizer.lr_scheduler(1000)
    assert [c.end for c in schedule.cycles] == [250, 500, 750, 1000]
    decays = [p for p in schedule.phases() if p.kind == "linear"]
    assert [(p.start, p.end) for p in decays] == [(200, 250), (450, 500), (700, 750), (950, 1000)]
    assert float(schedule(250)) == pytest.approx(3e-3)


def test_schedule_command_prints_phases_and_plots(repo_root: Path, tmp_path: Path, capsys):
    from loomax.cli import main

    out = tmp_path / "lr.png"
    main(
        [
            "schedule",
            "--config_path",
            str(repo_root / "config" / "quickstart.yaml"),
            "--optimizer.lr_schedule",
            "linear",
            "--optimizer.decay",
            "0.2",
            "--optimizer.cycles",
            "[100, 200]",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "cycle 0 warmup   steps       0-20" in printed
    assert "cycle 2 linear" in printed and "steps     440-500" in printed  # quickstart: 500 steps
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_command_names_a_bad_key(repo_root: Path, capsys):
    from loomax.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "schedule",
                "--config_path",
                str(repo_root / "config" / "quickstart.yaml"),
                "--optimizer.cycles",
                "3",
                "--optimizer.cycle_length",
                "10",
            ]
        )
    assert exit_info.value.code == 2
    assert "optimizer.cycle_length" in capsys.readouterr().err


def test_cycle_peaks_scale_each_cycle_and_keep_the_floor():
    # WSD-S with two cycles of 50 (decay 10 each) and a second peak of 0.5
    s = LrSchedule("linear", 1.0, 100, 10, 0.2, cycles=2, decay=10, cycle_peaks=[1.0, 0.5])
    same = LrSchedule("linear", 1.0, 100, 10, 0.2, cycles=2, decay=10)
    steps = np.arange(100)
    got, plain = np.asarray(s(steps)), np.asarray(same(steps))
    np.testing.assert_allclose(got[:50], plain[:50])  # first cycle untouched
    np.testing.assert_allclose(got[50:90], 0.5)  # the second peak (no rewarmup)
    assert got[99] == pytest.approx(0.2 + (0.5 - 0.2) * 0.1, rel=1e-6)  # to the same floor
    assert [p.lr_start for p in s.phases() if p.kind == "stable"] == pytest.approx([1.0, 0.5])
    with pytest.raises(ConfigError, match="cycle_peaks needs one positive multiple per cycle"):
        LrSchedule("linear", 1.0, 100, cycles=2, cycle_peaks=[1.0])
