"""Prepared task sets (``loomax eval prepare``): tasks evaluated offline from local files only."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from loomax.downstream import evaluate_tasks, lm_eval_model, task_manager
from loomax.downstream.prepared import check_prepared, prepare_tasks
from loomax.errors import UserError

# in the test extra: fails, not skips, without it
pytestmark = pytest.mark.usefixtures("needs_lm_eval")

# The tests that need lm-eval's own tasks index them with ``tasks_dir`` beside (one key of
# ``loomax.downstream._manager``): the module builds one manager over lm-eval's ~14,700 task
# YAMLs (~7 CPU-s to index, ~1.8 to read the index back from disk), not one with and one
# without a folder.


def arc_rows(mc: list[dict]) -> list[dict]:
    """The multiple-choice rows in ARC's layout (what lm-eval's ``arc_easy`` reads)."""
    return [
        {
            "id": f"q{i}",
            "question": row["question"],
            "choices": {"text": row["choices"], "label": ["A", "B", "C"][: len(row["choices"])]},
            "answerKey": "ABC"[row["answer"]],
        }
        for i, row in enumerate(mc)
    ]


@pytest.fixture(scope="module")
def lm(llama, tokenizer):
    return lm_eval_model(llama, tokenizer, batch_size=4)


@pytest.fixture(scope="module")
def prepared(tasks_dir, tmp_path_factory):
    """``tiny_mc``, ``tiny_ppl`` and ``tiny_gen`` prepared from a copy of the task folder,
    whose data files are then deleted: only the prepared set holds the documents."""
    source = tmp_path_factory.mktemp("source") / "tasks"
    shutil.copytree(tasks_dir, source)
    for path in source.glob("*.yaml"):  # point the copy's YAMLs at the copy's data
        path.write_text(path.read_text().replace(str(tasks_dir), str(source)))
    group = {"group": "tiny_group", "task": ["tiny_mc", "tiny_ppl"]}
    (source / "tiny_group.yaml").write_text(json.dumps(group))
    out = tmp_path_factory.mktemp("prepared") / "set"
    manager = task_manager(["tiny_group"], source, include_defaults=False, hub=True)
    prepare_tasks(["tiny_group"], out, manager, limit=4)  # a group: its tasks
    prepare_tasks(["tiny_gen"], out, manager)  # adds to the set
    for path in source.glob("*.jsonl"):
        path.unlink()
    return source, out


def test_prepare_writes_a_versioned_manifest_documents_and_requests(prepared, lm_eval_tasks):
    MC = lm_eval_tasks.MC
    source, out = prepared
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["lm_eval"] and manifest["datasets"]
    assert set(manifest["tasks"]) == {"tiny_mc", "tiny_ppl", "tiny_gen"}
    assert manifest["groups"] == {"tiny_group": ["tiny_mc", "tiny_ppl"]}
    mc = manifest["tasks"]["tiny_mc"]
    assert mc["splits"]["test"]["rows"] == len(MC) and mc["output_type"] == "multiple_choice"
    docs = [json.loads(line) for line in (out / "tiny_mc" / "test.jsonl").read_text().splitlines()]
    assert docs == MC
    requests = [
        json.loads(x) for x in (out / "tiny_mc" / "requests.jsonl").read_text().split("\n") if x
    ]
    # limit 4 documents, one loglikelihood request per choice
    assert len(requests) == sum(len(d["choices"]) for d in MC[:4]) == mc["requests"]["rows"]
    assert requests[0]["type"] == "loglikelihood"
    assert requests[0]["arguments"] == ["The cat sat on the", " mat"]


def test_prepared_tasks_score_as_the_originals_without_their_files(lm, tasks_dir, prepared):
    source, out = prepared
    want = evaluate_tasks(
        lm, ["tiny_mc", "tiny_ppl"], include_path=tasks_dir, include_defaults=False
    )["results"]
    got = evaluate_tasks(
        lm, ["tiny_group"], include_path=source, include_defaults=False, prepared=out
    )["results"]
    assert "tiny_group" in got
    for task in ("tiny_mc", "tiny_ppl"):
        for key, value in want[task].items():
            if isinstance(value, float):
                assert got[task][key] == pytest.approx(value, rel=1e-9), (task, key)
    with pytest.raises(Exception, match="mc.jsonl"):  # the copy lost its data files
        evaluate_tasks(lm, ["tiny_mc"], include_path=source, include_defaults=False)


@pytest.mark.slow
def test_builtin_task_is_served_from_the_prepared_set_offline(
    lm, tmp_path, lm_eval_tasks, tasks_dir
):
    """lm-eval's own ``arc_easy`` (its prompts and metrics) over documents in a prepared set
    written as prepare writes it from the hub: evaluation never reaches the hub."""
    import datasets

    ARC = arc_rows(lm_eval_tasks.MC)
    out = tmp_path / "set"
    (out / "arc_easy").mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in ARC)
    (out / "arc_easy" / "test.jsonl").write_text(text)
    features = datasets.Dataset.from_list(ARC).features.to_dict()
    entry = {"file": "test.jsonl", "rows": len(ARC), "features": features}
    entry["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    splits = {s: entry for s in ("train", "validation", "test")}
    manifest = {
        "format": 1,
        "tasks": {"arc_easy": {"version": 1.0, "splits": splits, "requests": {}}},
        "groups": {},
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    kwargs = dict(include_path=tasks_dir, prepared=out, bootstrap_iters=0)
    results = evaluate_tasks(lm, ["arc_easy"], **kwargs)["results"]
    assert 0 <= results["arc_easy"]["acc,none"] <= 1
    assert results["arc_easy"]["acc,none"] * len(ARC) == pytest.approx(
        round(results["arc_easy"]["acc,none"] * len(ARC))
    )

    manifest["tasks"]["arc_easy"]["version"] = 0.5  # lm-eval's task changed since
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="prepared at version 0.5.*loomax eval prepare"):
        evaluate_tasks(lm, ["arc_easy"], **kwargs)


def test_builtin_task_without_a_prepared_set_names_the_command(tasks_dir):
    with pytest.raises(UserError, match=r"arc_easy.*loomax eval prepare --tasks arc_easy --out"):
        task_manager(["arc_easy"], tasks_dir, where="--tasks")


def test_missing_or_damaged_prepared_task_names_the_task_and_the_command(
    prepared, tasks_dir, tmp_path
):
    source, out = prepared
    with pytest.raises(
        UserError, match=r"arc_easy not prepared in .*eval prepare --tasks arc_easy --out"
    ):  # tasks_dir's tiny_mc (prepared) is not named; the index is the prepare command test's
        task_manager(["arc_easy", "tiny_mc"], tasks_dir, prepared=out)
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    with (damaged / "tiny_mc" / "test.jsonl").open("a") as f:
        f.write("{}\n")
    with pytest.raises(UserError, match=r"tiny_mc/test.jsonl does not match its sha256"):
        check_prepared(damaged, ["tiny_mc"])
    with pytest.raises(UserError, match="not a prepared task set"):
        check_prepared(tmp_path, ["tiny_mc"])


@pytest.mark.slow
def test_loomax_eval_prepare_command(tasks_dir, tmp_path, capsys):
    from loomax.cli import main

    out = tmp_path / "set"
    main(
        [
            "eval",
            "prepare",
            "--tasks",
            "tiny_mc",
            "--include_path",
            str(tasks_dir),
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert (
        "tiny_mc" in printed and "test:5" in printed and f"prepared 1 task(s) in {out}" in printed
    )
    with pytest.raises(SystemExit) as exit:
        args = ["--tasks", "no_such_task", "--include_path", str(tasks_dir), "--out", str(out)]
        main(["eval", "prepare", *args])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("loomax eval prepare: error:") and "no_such_task" in err
