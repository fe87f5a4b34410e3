"""Contract: every registered hook type runs in one short train_lm run configured from YAML."""

from __future__ import annotations

import json

import pytest
import yaml

from loomax.config import parse_config
from loomax.train import HookConfig
from loomax.train_lm import TrainLmConfig, train_lm

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

HOOKS = {
    "batch_size_schedule": {"every": 4},
    "config_saver": {},
    "console": {"every": 2},
    "control": {"port": 0},
    "divergence": {"patience": 3},
    "early_stopping": {"patience": 5},
    "ema": {"decay": 0.9, "use_for_eval": True},
    "eval": {"every": 4, "max_batches": 1},
    "gc": {"every": 2},
    "hf_export": {"every": 4},
    "memory": {"every": 2},
    "metric_saver": {"every": 4, "include": ["train/*", "eval/*"]},
    "model_merge": {"steps": [4], "window": 2},
    "nan_check": {},
    "norms": {"every": 2, "histograms": True},
    "profiler": {"start": 2, "num_steps": 1},
    "progress": {},
    "seq_len_warmup": {"min_seq_len": 16, "warmup_steps": 4},
    "skip_bad_steps": {"window": 4, "min_history": 2},
    "speed": {"every": 2},
    "stability": {"window": 4, "every": 2, "min_history": 2},
    "textgen": {"every": 4, "prompts": ["def "], "max_new_tokens": 4},
}


def test_every_registered_hook_type_runs_from_yaml(tmp_path, tiny_corpus):
    built_in = {
        n for n, c in HookConfig.get_known_choices().items() if c.__module__.startswith("loomax.")
    }
    assert set(HOOKS) == built_in, "add new hook types to HOOKS"
    run_dir = tmp_path / "run"
    other = tmp_path / "other.jsonl"  # a second validation set
    docs = [{"text": f"class C{i}:\n    value = {i} * 3\n"} for i in range(100)]
    other.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    config = {
        "data": {
            "train": [{"urls": [str(tiny_corpus)]}],
            "validation": [{"urls": [str(tiny_corpus)]}, {"urls": [str(other)]}],
            "tokenizer_vocab_size": 300,
            "cache_dir": str(tmp_path / "cache"),
        },
        "model": {"seq_len": 32, "hidden_dim": 32, "num_layers": 2, "num_heads": 2},
        "optimizer": {"learning_rate": 0.01, "warmup": 2},
        "trainer": {
            "train_batch_size": 8,
            "num_train_steps": 8,
            "log_every": 4,
            "steps_per_eval": 8,
            "max_eval_batches": 2,
            "eval_at_start": False,
            "progress_bar": False,
            "run_dir": str(run_dir),
            "hooks": [{"type": name, **settings} for name, settings in HOOKS.items()],
        },
        "sample": {"enabled": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = train_lm(parse_config(TrainLmConfig, path))
    assert result.final.step == 8

    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(record)
    logged = {k for r in records.values() for k in r}
    for key in (
        "train/loss",  # the run's own logging
        "throughput/steps_per_second",  # speed
        "eval/train/bpb",  # per validation set (named by file)...
        "eval/other/perplexity",
        "eval/bpb",  # ...and their macro average
        "memory/host_rss_bytes",
        "norms/grad",
        "histograms/param",
        "optim/skipped_step",
        "stability/spike_score",
        "samples/0",
        "merge/saved_step",
        "train/seq_len",
        "data/tokens",  # batch_size_schedule
    ):
        assert key in logged, key
    final_eval = records[8]
    macro = (final_eval["eval/train/loss"] + final_eval["eval/other/loss"]) / 2
    assert final_eval["eval/loss"] == pytest.approx(macro)
    assert all("norms/grad" not in r for step, r in records.items() if step % 2)  # every 2
    assert (run_dir / "metrics_step4.json").exists() and (run_dir / "metrics.json").exists()
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 8
    assert list((run_dir / "profile").rglob("*.xplane.pb"))
    assert (run_dir / "merged" / "step-4" / "metadata.json").exists()
    assert (run_dir / "checkpoints" / "step-8" / "config.yaml").exists()
    assert not (run_dir / "control.json").exists()  # the server stopped with the run
    assert (run_dir / "hf" / "step-4" / "config.json").exists()  # hf_export: every 4 and at the end
    assert (run_dir / "hf" / "step-8" / "tokenizer.json").exists()
