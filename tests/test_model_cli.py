"""``loomax export|generate|eval --checkpoint``: from a real (tiny) Llama run with document masking."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from loomax.cli import main
from loomax.config import parse_config
from loomax.hf import load_hf
from loomax.inference import load_for_inference
from loomax.lm import TrainLmConfig
from loomax.train_lm import train_lm

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_corpus):
    root = tmp_path_factory.mktemp("llama_run")
    args = {
        "data.train": json.dumps([{"urls": [str(tiny_corpus)]}]),
        "data.tokenizer_vocab_size": "300",
        "data.validation_fraction": "0.1",
        "data.cache_dir": str(root / "cache"),
        "model.type": "llama",
        "model.seq_len": "32",
        "model.hidden_dim": "32",
        "model.intermediate_dim": "64",
        "model.num_layers": "2",
        "model.num_heads": "4",
        "model.num_kv_heads": "2",
        "model.document_mask": "true",
        "model.z_loss_weight": "1e-4",
        "trainer.train_batch_size": "8",
        "trainer.num_train_steps": "6",
        "trainer.steps_per_eval": "6",
        "trainer.run_dir": str(root / "run"),
        "trainer.progress_bar": "false",
        "sample.enabled": "false",
    }
    config = parse_config(TrainLmConfig, None, [x for k, v in args.items() for x in (f"--{k}", v)])
    result = train_lm(config)
    return root, result, config


def test_training_with_document_mask_ran(run):
    _, result, config = run
    assert result.final.state.model.config.document_mask
    assert [step for step, _ in result.evals] == [0, 6]
    (_, before), (_, after) = result.evals
    assert np.isfinite(after["eval/loss"]) and after["eval/loss"] < before["eval/loss"]


def test_export_writes_hf_directory_with_tokenizer(run, tmp_path, capsys):
    root, result, _ = run
    main(
        ["export", "--checkpoint", str(root / "run" / "checkpoints"), "--out", str(tmp_path / "hf")]
    )
    assert "exported checkpoint" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and "eos_token_id" in config
    exported = load_hf(tmp_path / "hf")
    trained = result.final.state.model
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)
    # the HF directory is itself a --checkpoint: generate from it, greedy, with its tokenizer
    greedy = ["--prompt", "def f", "--temperature", "0", "--max_new_tokens", "6"]
    main(["generate", "--checkpoint", str(tmp_path / "hf"), *greedy])
    from_hf = capsys.readouterr().out
    main(["generate", "--checkpoint", str(root / "run" / "checkpoints"), *greedy])
    assert capsys.readouterr().out == from_hf and from_hf.startswith("def f")


def test_eval_reports_per_set_and_macro(run, capsys):
    root, result, _ = run
    main(["eval", "--checkpoint", str(root / "run" / "checkpoints"), "--json"])
    metrics = json.loads(capsys.readouterr().out)
    for key in (
        "eval/loss",
        "eval/perplexity",
        "eval/bpb",
        "eval/validation/loss",
        "eval/validation/bpb",
    ):
        assert key in metrics and np.isfinite(metrics[key]), key
    assert metrics["eval/loss"] == pytest.approx(result.evals[-1][1]["eval/loss"], rel=1e-4)
    main(["eval", "--checkpoint", str(root / "run" / "checkpoints")])
    assert "macro average" in capsys.readouterr().out


def test_bad_checkpoint_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x"])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_for_inference(tmp_path / "missing")


def test_bad_context_split_is_a_usage_error_before_loading(tmp_path, capsys):
    """``generate --context`` must divide the devices (one here): refused before the missing
    checkpoint is looked at."""
    for bad in ("3", "0"):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x",
                  "--context", bad])  # fmt: skip
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"--context {bad} must be a positive divisor" in err


def test_load_for_inference_returns_the_trained_weights_and_config(run):
    root, result, config = run
    loaded = load_for_inference(root / "run" / "checkpoints")
    assert loaded.run_config.model == config.model
    assert loaded.run_config.data.train == config.data.train
    assert loaded.model.config == result.final.state.model.config
    assert f"step-{config.trainer.num_train_steps}" in loaded.description  # the latest one
    assert loaded.tokenizer is not None and loaded.tokenizer.is_file()
    trained = jax.tree.leaves(result.final.state.model)
    got = jax.tree.leaves(loaded.model)
    assert len(got) == len(trained) > 0
    for a, b in zip(got, trained, strict=True):
        assert a.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_array_equal(a, np.asarray(b, np.float32))


def test_eval_tasks_on_a_trainer_checkpoint(run, tmp_path, capsys, needs_lm_eval):
    """``loomax eval --tasks`` (lm-eval, tests/downstream has the rest) with the run's tokenizer."""
    root, _, _ = run
    rows = [
        {"question": "def f", "choices": ["(x):", " ]]] ((("], "answer": 0},
        {"question": "import", "choices": [" os", "))) ["], "answer": 0},
    ]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "task": "code_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "hf")},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": "",
        "metric_list": [{"metric": "acc"}],
    }
    (tmp_path / "code_mc.yaml").write_text(json.dumps(task))
    checkpoint = str(root / "run" / "checkpoints")
    out = tmp_path / "results.json"
    main(["eval", "--checkpoint", checkpoint, "--tasks", "code_mc", "--include_path",
          str(tmp_path), "--no_default_tasks", "--out", str(out), "--json"])  # fmt: skip
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert 0 <= printed["code_mc"]["acc,none"] <= 1
    assert (
        json.loads(out.read_text())["results"]["code_mc"]["acc,none"]
        == printed["code_mc"]["acc,none"]
    )
