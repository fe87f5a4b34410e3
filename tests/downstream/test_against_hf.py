"""Loomax's lm-eval backend against lm-eval's own ``hf`` backend (transformers, torch CPU)
on the same model exported by ``loomax.hf``: log-likelihoods to 1e-4, accuracies exactly."""

from __future__ import annotations

import json

import pytest

from loomax.data.tokenizer import EOS_TOKEN, load_tokenizer
from loomax.downstream import evaluate_tasks, lm_eval_model
from loomax.hf import export_hf, special_token_ids

# in the test extra: fails, not skips, without it
pytestmark = pytest.mark.usefixtures("needs_hf_backend")

TASKS = ["tiny_mc", "tiny_ppl"]


def _run(lm, tasks_dir):
    return evaluate_tasks(
        lm, TASKS, include_path=tasks_dir, include_defaults=False, log_samples=True,
        bootstrap_iters=0,
    )  # fmt: skip


def _loglikelihoods(results, task):
    out = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        for resp in sample["filtered_resps"]:
            out.append(float(resp[0]) if isinstance(resp, list | tuple) else float(resp))
    return out


def test_same_scores_as_lm_eval_hf_backend(llama, tokenizer_path, tasks_dir, tmp_path):
    import torch
    from lm_eval.models.huggingface import HFLM

    export_hf(
        llama,
        tmp_path / "hf",
        tokenizer=tokenizer_path,
        special_tokens=special_token_ids(load_tokenizer(tokenizer_path)),
    )
    # lm-eval's hf backend takes EOS from the tokenizer: the export names it
    tok_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == tok_config["bos_token"] == EOS_TOKEN
    hf = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", dtype=torch.float32, batch_size=4)
    ours = _run(lm_eval_model(llama, tokenizer_path, batch_size=4), tasks_dir)
    theirs = _run(hf, tasks_dir)
    for task in TASKS:
        got, want = _loglikelihoods(ours, task), _loglikelihoods(theirs, task)
        assert len(got) == len(want) > 0
        assert got == pytest.approx(want, abs=1e-4, rel=1e-5)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == theirs["results"]["tiny_mc"][metric]
