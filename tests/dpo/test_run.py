"""``loomax dpo`` on the shipped config and preference set: the held-out preference accuracy
rises from the reference's chance level to >= 85%, metrics are logged under ``dpo/``, and a
resumed run reads the cached reference log-probs instead of recomputing them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loomax.cli import main

CONFIG = Path(__file__).parents[2] / "config" / "dpo_tiny.yaml"
SHIPPED = CONFIG.parent / "dpo" / "sort_letters"


def _subset(tmp_path, train: int, validation: int) -> list[str]:
    """Flags that train on the first ``train`` shipped pairs and hold out ``validation``."""
    flags = []
    for name, n in (("train", train), ("validation", validation)):
        lines = (SHIPPED / f"{name}.jsonl").read_text().splitlines(keepends=True)[:n]
        (tmp_path / f"{name}.jsonl").write_text("".join(lines))
        flags += [f"--dpo.{name}", str(tmp_path / f"{name}.jsonl")]
    return flags


def _dpo(tmp_path, *flags):
    main(["dpo", "--config_path", str(CONFIG), "--trainer.run_dir", str(tmp_path / "run"),
          "--trainer.progress_bar", "false", *flags])  # fmt: skip


@pytest.mark.slow  # ~10 s: a tiny Llama's reference pass, 10 steps and an eval, then a resume
def test_dpo_lifts_held_out_preference_accuracy_and_resumes_from_the_cached_reference(
    tmp_path, capsys, monkeypatch
):
    import loomax.dpo.run as run

    subset = _subset(tmp_path, 320, 64)  # 10 steps of 32 pairs: each pair once
    _dpo(tmp_path, *subset, "--trainer.num_train_steps", "10", "--trainer.steps_per_eval", "10",
         "--trainer.eval_at_start", "false")  # fmt: skip
    out = capsys.readouterr().out
    baseline = float(out.split("prefers the chosen response of: ")[1].split("%")[0])
    assert 35.0 <= baseline <= 65.0  # the reference (fresh weights) is at chance
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    train = [r for r in records if "train/loss" in r]
    assert {
        "dpo/rewards/chosen",
        "dpo/rewards/rejected",
        "dpo/rewards/margins",
        "dpo/rewards/accuracies",
    } <= set(train[-1])
    final = [r for r in records if "eval/dpo/rewards/accuracies" in r][-1]
    assert final["step"] == 10 and final["eval/dpo/rewards/accuracies"] >= 0.85
    with np.load(tmp_path / "run" / "dpo_reference.npz") as reference:  # held-out rewards use it
        ref_chosen = float(reference["validation/chosen"].mean())
    beta = 0.1  # config/dpo_tiny.yaml
    expected = beta * (final["eval/dpo/logps/chosen"] - ref_chosen)
    assert final["eval/dpo/rewards/chosen"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert (tmp_path / "run" / "model" / "model.yaml").is_file()  # the policy, for loomax export

    def no_second_pass(*args, **kwargs):
        raise AssertionError("a resumed run computed the reference again")

    monkeypatch.setattr(run, "compute_reference", no_second_pass)
    _dpo(tmp_path, *subset, "--trainer.num_train_steps", "11", "--trainer.steps_per_eval", "100",
         "--trainer.eval_at_start", "false")  # fmt: skip
    assert "steps: 11 of 11" in capsys.readouterr().out


def test_a_bad_pair_stops_the_command_naming_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "a"}\n'
    )
    with pytest.raises(SystemExit) as exit_:
        _dpo(tmp_path, "--dpo.train", str(bad))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"loomax dpo: error: {bad}:2: the pair has no 'rejected'" in err
