"""Contract: every registered hook type runs in one short train_lm run configured from YAML,
and every stateful built-in hook's state survives a real checkpoint."""

from __future__ import annotations

import json

import pytest
import yaml

from loomax.config import parse_config
from loomax.lm import TrainLmConfig
from loomax.train import Hook, HookConfig, HookContext
from loomax.train_lm import train_lm

NOTIFY_URL = "http://127.0.0.1:9/services/s3cr3t"
"""The discard port: nothing answers there."""

SETTINGS = {
    "activations": {"every": 2},
    "batch_size_schedule": {"every": 4},
    "config_saver": {},
    "console": {"every": 2},
    "control": {"port": 0},
    "divergence": {"patience": 3},
    "downstream_eval": {"every": 8, "tasks": ["contract_mc"], "default_tasks": False, "limit": 2},
    "dump_gradients": {"steps": [4]},
    "early_stopping": {"patience": 5},
    "ema": {"decay": 0.9, "use_for_eval": True},
    "eval": {"every": 4, "max_batches": 1},
    "gc": {"every": 2},
    "hf_export": {"every": 4},
    "log_metrics": {"every": 2},
    "memory": {"every": 2},
    "metric_saver": {"every": 4, "include": ["train/*", "eval/*"]},
    "model_merge": {"steps": [4], "window": 2},
    "nan_check": {},
    "norms": {"every": 2, "histograms": True, "spectral": True},
    "notify": {"url": NOTIFY_URL, "every": 4, "timeout": 1},  # nothing listens: posts only warn
    "profiler": {"wait": 1, "active": 1},
    "progress": {},
    "router_collapse": {"patience": 2, "every": 2},
    # step 1 at 16 tokens, the rest at 32: the activation statistics (even steps) compile at 32
    # only, one variant of the step fewer than a warm-up that reaches into them
    "seq_len_warmup": {"min_seq_len": 16, "warmup_steps": 1},
    "speed": {"every": 2},
    "stability": {"window": 4, "every": 2, "min_history": 2},
    "step_programs": {},
    "textgen": {"every": 8, "prompts": ["def "], "max_new_tokens": 4},
    "wandb_cancel": {"check_seconds": 60},  # no wandb run here: it says so and stays off
}
"""Settings that make a hook act within this short run; a type not listed runs with its defaults."""


def built_in_types() -> dict[str, type[HookConfig]]:
    """The hook types Loomax registers (not tests' and not the removed ones)."""
    import loomax.hooks  # noqa: F401 - registers the built-in types

    return {
        name: cls
        for name, cls in HookConfig.get_known_choices().items()
        if cls.__module__.startswith("loomax.") and cls.hook_class is not None
    }


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_every_registered_hook_type_runs_from_yaml(tmp_path, tiny_corpus, lm_eval_tasks):
    built_in = set(built_in_types())
    assert set(SETTINGS) <= built_in, "SETTINGS names a hook type that is not registered"
    run_dir = tmp_path / "run"
    other = tmp_path / "other.jsonl"  # a second validation set
    docs = [{"text": f"class C{i}:\n    value = {i} * 3\n"} for i in range(100)]
    other.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [
        {"question": "value =", "choices": [" 3", " C"], "answer": 0},
        {"question": "class", "choices": [" C1:", " = 3"], "answer": 0},
    ]  # two questions about the tiny corpus
    lm_eval_tasks.write_task(tasks, "contract_mc", rows, **lm_eval_tasks.MULTIPLE_CHOICE)
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
            "hooks": [
                {
                    "type": name,
                    **settings,
                    **({"include_path": str(tasks)} if name == "downstream_eval" else {}),
                }
                for name, settings in [
                    *SETTINGS.items(),
                    *((n, {}) for n in sorted(built_in - set(SETTINGS))),
                ]
            ],
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
        "stability/spike_score",
        "samples/0",
        "merge/saved_step",
        "train/seq_len",
        "data/tokens",  # batch_size_schedule
        "downstream/contract_mc/acc",  # downstream_eval (lm-eval)
    ):
        assert key in logged, key
    assert any(k.startswith("norms/spectral/") for k in logged)
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
    assert [p.name for p in (run_dir / "gradients").iterdir()] == ["step-4.safetensors"]
    assert (run_dir / "artifacts" / "train_step.hlo.txt").read_text().startswith("HloModule")
    saved = [run_dir / "config.yaml", run_dir / "checkpoints" / "step-8" / "config.yaml"]
    saved += [run_dir / "checkpoints" / "step-8" / "metadata.json", run_dir / "hparams.json"]
    assert all("s3cr3t" not in path.read_text() for path in saved)  # notify's URL is secret


STATEFUL = {
    "divergence": {"warmup": 1, "patience": 50},
    "early_stopping": {"patience": 5},
    "eval": {"every": 2},
    "stability": {"window": 4, "every": 2, "min_history": 2},
    "router_collapse": {"every": 1, "patience": 2},
}
"""Settings of the built-in hooks with a ``state_dict`` (all of them)."""


def test_stateful_hooks_state_round_trips_through_a_checkpoint(tiny, tmp_path):
    stateful = {
        name
        for name, cls in built_in_types().items()
        if cls.hook_class.state_dict is not Hook.state_dict
    }
    # downstream_eval needs a tokenizer and lm-eval tasks: its state's round trip through a
    # real checkpoint and resume is tests/hooks/test_downstream_eval.py's
    assert stateful == set(STATEFUL) | {"downstream_eval"}, (
        "add new stateful hook types to STATEFUL"
    )
    eval_losses = iter([3.0, 2.0, 2.5, 2.6, 2.7])

    def run(steps):
        trainer = tiny.trainer(tmp_path, steps=steps)
        context = HookContext(
            trainer.runtime,
            trainer_config=trainer.config,
            run_dir=trainer.run_dir,
            evaluator=lambda model: {"eval/loss": next(eval_losses)},
        )
        known = HookConfig.get_known_choices()
        hooks = [known[name](**settings).build(context) for name, settings in STATEFUL.items()]
        for hook in hooks:
            trainer.add_hook(hook)
        return trainer, hooks

    first, hooks = run(steps=6)
    first.train(tiny.init(first), tiny.batches())
    first.finish()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-6" / "metadata.json"
    saved = json.loads(checkpoint.read_text())["hooks"]
    assert set(saved) == {hook.name for hook in hooks}
    assert saved["EvalHook[every=2]"]["last_step"] == 6 and saved["StabilityMonitor"]["flags"]
    assert saved["EarlyStoppingHook"] == {"best": 2.0, "evals_without_improvement": 1}

    second, fresh = run(steps=6)
    loaded = {}

    class Snapshot(Hook):
        priority = 1000  # before the others: what was loaded, untouched

        def on_train_begin(self, info):
            loaded.update({hook.name: hook.state_dict() for hook in fresh})

    second.add_hook(Snapshot())
    second.train(tiny.init(second), tiny.batches())  # resumes at step 6: states load, nothing runs
    second.finish()
    assert json.loads(json.dumps(loaded)) == saved
