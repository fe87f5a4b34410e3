"""Downstream evaluation during training: lm-eval tasks over local JSONL files (no network)
on the tiny trainer's model, logged as downstream/<task>/<metric> with a macro average."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loomax.data.tokenizer import train_bpe_tokenizer
from loomax.errors import UserError
from loomax.hooks import DownstreamEvalHook
from loomax.hooks.downstream_eval import downstream_metrics
from loomax.train import HookConfig, HookContext

# in the test extra: fails, not skips, without it
pytestmark = pytest.mark.usefixtures("needs_lm_eval")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, lm_eval_tasks):
    from loomax.data.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe_tokenizer(lm_eval_tasks.CORPUS, 280, path)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory, lm_eval_tasks) -> Path:
    """``mc_a``/``mc_b`` (multiple choice: acc, acc_norm) and ``ppl`` (bits per byte)."""
    t = lm_eval_tasks
    root = tmp_path_factory.mktemp("tasks")
    t.write_task(root, "mc_a", t.MC, **t.MULTIPLE_CHOICE)
    t.write_task(root, "mc_b", t.MC[::-1], **t.MULTIPLE_CHOICE)
    t.write_task(root, "ppl", t.DOCS, **t.rolling("bits_per_byte"))
    return root


def make_hook(tokenizer, tasks_dir, **settings):
    settings = {
        "every": 2,
        "tasks": ["mc_a", "mc_b", "ppl"],
        "include_path": str(tasks_dir),
        "default_tasks": False,
        "batch_size": 4,
        "bootstrap_iters": 10,
        **settings,
    }
    return DownstreamEvalHook(tokenizer=tokenizer, **settings)


def logged(run_dir: Path) -> dict[int, dict]:
    records: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(record)
    return records


def test_tasks_are_logged_every_n_steps_and_at_the_end(tiny, tokenizer, tasks_dir, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=5)
    hook = make_hook(tokenizer, tasks_dir)
    trainer.add_hook(hook)
    vocab = tokenizer.get_vocab_size()
    state = trainer.initial_state(lambda key: tiny.model.build(vocab, key=key))
    rng = np.random.default_rng(0)
    batches = (rng.integers(0, vocab, (4, tiny.model.seq_len), dtype=np.int32) for _ in range(5))
    trainer.train(state, batches)
    trainer.finish()

    assert [s for s, _ in hook.history] == [2, 4, 5]  # every 2, then at the end
    records = logged(Path(trainer.run_dir))
    for step in (1, 3):
        assert not any(k.startswith("downstream/") for k in records.get(step, {}))
    for step, metrics in hook.history:
        record = records[step]
        assert {k: record[k] for k in metrics} == metrics
        for task in ("mc_a", "mc_b"):
            for metric in ("acc", "acc_norm"):
                assert 0 <= record[f"downstream/{task}/{metric}"] <= 1
                assert record[f"downstream/{task}/{metric}_stderr"] >= 0
        assert 0 < record["downstream/ppl/bits_per_byte"] < 30
        for metric in ("acc", "acc_norm"):  # in two tasks: averaged
            mean = (record[f"downstream/mc_a/{metric}"] + record[f"downstream/mc_b/{metric}"]) / 2
            assert record[f"downstream/average/{metric}"] == pytest.approx(mean)
        assert "downstream/average/bits_per_byte" not in record  # in one task only
        assert not any(k.startswith("downstream/average/") and "stderr" in k for k in record)

    # the state is saved with the checkpoint, and a resumed run does not evaluate step 5 again
    metadata = Path(trainer.run_dir) / "checkpoints" / "step-5" / "metadata.json"
    saved = json.loads(metadata.read_text())["hooks"]["DownstreamEvalHook"]
    assert saved == json.loads(json.dumps(hook.state_dict()))
    assert saved["last_step"] == 5
    second = tiny.trainer(tmp_path, steps=5)
    resumed = make_hook(tokenizer, tasks_dir)
    resumed.evaluate = lambda model: pytest.fail("a resumed run evaluated step 5 again")
    second.add_hook(resumed)
    second.train(second.initial_state(lambda key: tiny.model.build(vocab, key=key)), batches)
    second.finish()
    assert resumed.last_step == 5
    assert resumed.history == [(s, m) for s, m in json.loads(json.dumps(hook.history))]


def test_unknown_task_fails_when_built(tokenizer, tasks_dir, tmp_path):
    config = HookConfig.get_choice_class("downstream_eval")(  # as trainer.hooks builds it
        tasks=["mc_a", "no_such_task"], include_path=str(tasks_dir), default_tasks=False
    )
    with pytest.raises(UserError, match="no_such_task") as error:
        config.build(HookContext(runtime=None, tokenizer=tokenizer))
    assert str(tasks_dir) in str(error.value) and "mc_a" not in str(error.value)
    with pytest.raises(UserError, match="include_path"):
        make_hook(tokenizer, tmp_path / "missing")
    with pytest.raises(ValueError, match=r"downstream_eval\): tasks must not be empty"):
        DownstreamEvalHook.Config(tasks=[])


def test_metrics_of_lm_eval_results():
    results = {
        "results": {
            "a": {"alias": "a", "acc,none": 0.5, "acc_stderr,none": 0.1, "f1,none": 0.2},
            "b": {"alias": "b", "acc,none": 1.0, "acc_stderr,none": "N/A"},
            "g": {"alias": "g", "acc,none": 0.0},
            "c": {"exact_match,strict": 1.0},
        },
        "groups": {"g": {}},
    }
    assert downstream_metrics(results) == {
        "downstream/a/acc": 0.5,
        "downstream/a/acc_stderr": 0.1,
        "downstream/a/f1": 0.2,
        "downstream/b/acc": 1.0,
        "downstream/g/acc": 0.0,
        "downstream/c/strict/exact_match": 1.0,
        "downstream/average/acc": 0.75,  # the group g is not a task of the average
    }


@pytest.mark.slow
def test_unprepared_builtin_task_fails_when_built(tokenizer, tasks_dir, tmp_path):
    """lm-eval's own tasks are read only from a prepared set: one missing from it stops the
    run when the hook is built (before any compile), naming the command that makes it."""
    from loomax.downstream import task_manager
    from loomax.downstream.prepared import prepare_tasks

    prepared = tmp_path / "prepared"
    manager = task_manager(["mc_a"], tasks_dir, include_defaults=False, hub=True)
    prepare_tasks(["mc_a"], prepared, manager)
    config = HookConfig.get_choice_class("downstream_eval")(
        tasks=["mc_a", "arc_easy"], include_path=str(tasks_dir), prepared=str(prepared)
    )
    with pytest.raises(UserError, match="arc_easy not prepared") as error:
        config.build(HookContext(runtime=None, tokenizer=tokenizer))
    assert f"loomax eval prepare --tasks arc_easy --out {prepared}" in str(error.value)
    assert str(error.value).startswith("trainer.hooks (downstream_eval)")
