"""``LoomaxLM`` under lm-eval's own evaluator, on tiny local tasks (tests/downstream/conftest.py)."""

from __future__ import annotations

import json
import math
import shutil

import jax
import numpy as np
import pytest

from loomax.downstream import evaluate_tasks, lm_eval_model, write_results
from loomax.models.decoding.generate import sample_tokens

from .test_scoring import direct

# in the test extra: fails, not skips, without it
pytestmark = pytest.mark.usefixtures("needs_lm_eval")


class Req:
    """What lm-eval hands an ``LM``: an object with ``args``."""

    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def lm(llama, tokenizer):
    return lm_eval_model(llama, tokenizer, batch_size=4)


def test_loglikelihood_matches_the_model_logits(lm, llama, tokenizer):
    pairs = [("The cat sat on the", " mat"), ("Paris is", " the capital"), ("", "Ice is cold")]
    got = lm.loglikelihood([Req(*p) for p in pairs])
    eot = lm.eot_token_id
    for (ctx, cont), (logp, greedy) in zip(pairs, got, strict=True):
        whole = tokenizer.encode(ctx + cont).ids
        ctx_ids = tokenizer.encode(ctx).ids if ctx else [eot]
        cont_ids = whole[len(ctx_ids) :] if ctx else whole
        want_logp, want_greedy = direct(llama, ctx_ids, cont_ids)
        assert math.isfinite(logp) and logp < 0
        assert abs(logp - want_logp) < 1e-4
        assert greedy == want_greedy


def test_loglikelihood_rolling_covers_every_token_once(lm, llama, tokenizer):
    short, long = "Water is wet.", "The dog sat on the log. " * 8
    ids = tokenizer.encode(long).ids
    assert len(ids) > llama.config.seq_len  # several windows
    got_short, got_long = lm.loglikelihood_rolling([Req(short), Req(long)])
    short_ids = tokenizer.encode(short).ids
    assert abs(got_short - direct(llama, [lm.eot_token_id], short_ids)[0]) < 1e-4
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows = [
        make_disjoint_window(w)
        for w in get_rolling_token_windows(ids, lm.eot_token_id, max_seq_len=32, context_len=1)
    ]
    assert len(windows) > 1 and sum((cont for _, cont in windows), []) == ids
    assert all(len(ctx) + len(cont) <= 33 for ctx, cont in windows)
    want = sum(direct(llama, ctx, cont)[0] for ctx, cont in windows)
    assert abs(got_long - want) < 1e-3
    assert math.isfinite(got_long) and got_long < got_short


def test_generate_until_is_greedy_and_stops_at_the_stop_string(lm, llama, tokenizer):
    prompt = "The cat sat"
    ids = tokenizer.encode(prompt).ids
    want = sample_tokens(
        llama, ids, seq_len=32, max_new_tokens=6, temperature=0.0, key=jax.random.PRNGKey(0)
    )[len(ids) :]
    text = tokenizer.decode(want)
    (free,) = lm.generate_until([Req(prompt, {"until": [], "max_gen_toks": 6})])
    assert free == text.split("<|endoftext|>")[0] and len(free) > 1
    stop = free[len(free) // 2 :]
    (cut,) = lm.generate_until([Req(prompt, {"until": [stop], "max_gen_toks": 6})])
    assert cut == free[: free.index(stop)]


def test_generate_until_batches_requests_as_if_alone(lm):
    """Five requests in two option groups (batch_size 4: three batches) give what each
    gives alone."""
    greedy = {"until": ["."], "max_gen_toks": 5}
    longer = {"until": [], "max_gen_toks": 8}
    prompts = ["The cat sat", "Paris is the", "Two plus", "Ice", "Water is wet and fire"]
    requests = [Req(p, greedy if i % 2 else longer) for i, p in enumerate(prompts)]
    together = lm.generate_until(requests)
    assert together == [lm.generate_until([r])[0] for r in requests]
    assert len(set(together)) > 2


def test_simple_evaluate_on_local_tasks_writes_results(lm, tasks_dir, tmp_path):
    results = evaluate_tasks(
        lm,
        ["tiny_mc", "tiny_ppl", "tiny_gen"],
        include_path=tasks_dir,
        include_defaults=False,
        bootstrap_iters=0,
    )
    scores = results["results"]
    # the environment named without torch's collect_env (which imports torch, runs pip list)
    assert results["pretty_env_info"].startswith("jax ") and results["lm_eval_version"]
    for metric in ("acc,none", "acc_norm,none"):
        assert 0 <= scores["tiny_mc"][metric] <= 1
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isfinite(scores["tiny_ppl"][metric]) and scores["tiny_ppl"][metric] > 0
    assert 0 <= scores["tiny_gen"]["exact_match,none"] <= 1
    out = write_results(results, tmp_path / "results.json")
    assert (
        json.loads(out.read_text())["results"]["tiny_mc"]["acc,none"]
        == scores["tiny_mc"]["acc,none"]
    )


def test_multiple_choice_accuracy_from_the_logits(lm, llama, tokenizer, tasks_dir, lm_eval_tasks):
    MC = lm_eval_tasks.MC
    results = evaluate_tasks(
        lm, ["tiny_mc"], include_path=tasks_dir, include_defaults=False, bootstrap_iters=0
    )
    correct = 0
    for doc in MC:
        ctx = tokenizer.encode(doc["question"]).ids
        scores = []
        for choice in doc["choices"]:
            whole = tokenizer.encode(doc["question"] + " " + choice).ids
            scores.append(direct(llama, ctx, whole[len(ctx) :])[0])
        correct += int(np.argmax(scores)) == doc["answer"]
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(correct / len(MC))


def test_unknown_task_is_a_user_error(lm, tasks_dir):
    from loomax.errors import UserError

    with pytest.raises(UserError, match="no_such_task"):
        evaluate_tasks(lm, ["no_such_task"], include_path=tasks_dir, include_defaults=False)


def test_loomax_eval_tasks_command(llama, tokenizer_path, tasks_dir, tmp_path, capsys):
    from loomax.cli import main

    llama.save(tmp_path / "model")
    out = tmp_path / "out" / "results.json"
    main(
        [
            "eval", "--model", str(tmp_path / "model"), "--tokenizer", str(tokenizer_path),
            "--tasks", "tiny_mc,tiny_ppl", "--include_path", str(tasks_dir),
            "--no_default_tasks", "--limit", "3", "--out", str(out), "--batch_size", "2",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "tiny_mc" in printed and "bits_per_byte" in printed
    results = json.loads(out.read_text())
    assert 0 <= results["results"]["tiny_mc"]["acc,none"] <= 1
    assert math.isfinite(results["results"]["tiny_ppl"]["word_perplexity,none"])
    assert results["n-samples"]["tiny_mc"]["effective"] == 3


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "no_such_task"], "unknown lm-eval task"),
        (["--limit", "3"], "--limit needs --tasks"),
        (["--tasks", "tiny_mc", "--limit", "0"], "--limit must be > 0"),
    ],
)
def test_loomax_eval_tasks_errors_are_one_line(
    llama, tokenizer_path, tasks_dir, tmp_path, capsys, extra, message
):
    from loomax.cli import main

    llama.save(tmp_path / "model")
    args = ["eval", "--model", str(tmp_path / "model"), "--tokenizer", str(tokenizer_path)]
    args += ["--include_path", str(tasks_dir), "--no_default_tasks", *extra]
    if "--tasks" not in extra:
        args = [
            a for a in args if a not in ("--include_path", str(tasks_dir), "--no_default_tasks")
        ]
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_lm_eval_names_the_extra(llama, tokenizer, monkeypatch):
    import sys

    from loomax.errors import MissingPackageError

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(MissingPackageError, match=r"loomax\[eval\]"):
        lm_eval_model(llama, tokenizer)


def test_missing_lm_eval_is_one_line_before_loading(tmp_path, monkeypatch, capsys):
    import sys

    from loomax.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(SystemExit) as exit:
        main(["eval", "--model", str(tmp_path / "missing"), "--tasks", "x"])
    assert exit.value.code == 2
    assert "pip install 'loomax[eval]'" in capsys.readouterr().err


def test_import_loomax_does_not_import_lm_eval():
    import subprocess
    import sys

    code = (
        "import sys, loomax, loomax.cli, loomax.model_cli, loomax.downstream; "
        "assert 'lm_eval' not in sys.modules, 'lm_eval imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_process_indexes_a_set_of_task_folders_once_and_again_when_edited(
    tasks_dir, tmp_path, lm_eval_tasks
):
    """lm-eval's index of its ~14,700 built-in task YAMLs (~7 CPU-s to build, ~1.8 to read
    back from disk: tests/downstream/test_task_index.py) is built once a process
    for a set of folders; a folder whose YAMLs change is indexed again. (The built-in tasks
    are indexed once here, with the session's ``tasks_dir``, as test_prepared.py indexes
    them: a process running both builds that index once. The edit is checked on an edited
    copy's index without them: the folders' key is the same with or without them.)"""
    from loomax.downstream import task_manager

    first = task_manager(["tiny_mc"], tasks_dir, hub=True)
    assert task_manager(["tiny_mc"], tasks_dir, hub=True) is first
    assert "arc_easy" in first.all_tasks and "tiny_mc" in first.all_tasks
    folder = tmp_path / "tasks"
    shutil.copytree(tasks_dir, folder)
    alone = task_manager(["tiny_mc"], folder, include_defaults=False, hub=True)
    assert alone is not first and "arc_easy" not in alone.all_tasks
    assert task_manager(["tiny_mc"], folder, include_defaults=False, hub=True) is alone
    t = lm_eval_tasks
    t.write_task(folder, "tiny_mc2", t.MC, data="mc2", **t.MULTIPLE_CHOICE)
    again = task_manager(["tiny_mc2"], folder, include_defaults=False, hub=True)
    assert again is not alone and "tiny_mc2" in again.all_tasks
