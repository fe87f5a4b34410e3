"""End to end: train_lm on a small local corpus, and the quickstart through the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from loomax.config import ConfigError, parse_config
from loomax.lm import TrainLmConfig
from loomax.train_lm import train_lm

pytestmark = pytest.mark.usefixtures("ray_cluster")  # one local Ray for the cache builds here


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One data cache for the module's runs of the small config: the first run builds its
    tokenizer and token cache, the others (same data settings) read them. A test that checks
    that nothing is built passes a folder of its own."""
    return tmp_path_factory.mktemp("cache")


def small_config(tmp_path, corpus, *extra, cache):
    return parse_config(TrainLmConfig, None, small_args(tmp_path, corpus, *extra, cache=cache))


def small_args(tmp_path, corpus, *extra, cache):
    return [
        "--data.train",
        json.dumps([{"urls": [str(corpus)]}]),
        "--data.tokenizer_vocab_size",
        "300",
        "--data.validation_fraction",
        "0.1",
        "--data.cache_dir",
        str(cache),
        "--model.seq_len",
        "32",
        "--model.hidden_dim",
        "32",
        "--model.num_layers",
        "2",
        "--model.num_heads",
        "2",
        "--trainer.train_batch_size",
        "8",
        "--trainer.num_train_steps",
        "40",
        "--trainer.log_every",
        "10",
        "--trainer.steps_per_eval",
        "20",
        "--trainer.run_dir",
        str(tmp_path / "run"),
        "--trainer.progress_bar",
        "false",
        "--optimizer.learning_rate",
        "0.01",
        "--optimizer.warmup",
        "5",
        "--sample.max_new_tokens",
        "8",
        *extra,
    ]


def test_train_lm_learns_and_writes_contract(tmp_path, tiny_corpus, cache):
    result = train_lm(small_config(tmp_path, tiny_corpus, cache=cache))
    evals = dict(result.evals)
    assert sorted(evals) == [0, 20, 40]
    assert evals[40]["eval/loss"] < 0.6 * evals[0]["eval/loss"]
    assert result.sample and isinstance(result.sample, str)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 10, 20, 30, 40]
    for r in records[1:]:
        for key in (
            "train/loss",
            "optim/learning_rate",
            "throughput/tokens_per_second",
            "throughput/mfu",
        ):
            assert key in r, (r["step"], key)
    assert "eval/loss" in records[0] and "eval/loss" in records[2] and "eval/loss" in records[4]
    assert (tmp_path / "run" / "config.yaml").exists()
    assert (
        parse_config(TrainLmConfig, tmp_path / "run" / "config.yaml").trainer.num_train_steps == 40
    )


def test_same_seed_same_trajectory(tmp_path, tiny_corpus, cache):
    a = train_lm(
        small_config(
            tmp_path / "a",
            tiny_corpus,
            "--trainer.num_train_steps",
            "6",
            "--sample.enabled",
            "false",
            cache=cache,
        )
    )
    b = train_lm(
        small_config(
            tmp_path / "b",
            tiny_corpus,
            "--trainer.num_train_steps",
            "6",
            "--sample.enabled",
            "false",
            cache=cache,
        )
    )
    assert a.final.host_metrics()["train/loss"] == b.final.host_metrics()["train/loss"]
    assert a.evals == b.evals


def test_vocab_smaller_than_tokenizer_is_an_error(tmp_path, tiny_corpus, cache):
    with pytest.raises(ValueError, match="model.vocab_size"):
        train_lm(small_config(tmp_path, tiny_corpus, "--model.vocab_size", "100", cache=cache))


@pytest.mark.slow
def test_quickstart_cli_few_steps(tmp_path, repo_root, ray_cluster):
    # the quickstart config as `make demo` runs it (its own BPE, the token cache, training,
    # evals, a sample), smaller: the first 200 standard-library files (the whole library's
    # tokenizer and cache cost a minute of CPU here) and batches of 8 rows, not 32 (on a cold
    # cache the test takes 12 instead of 19 CPU-seconds). Its cache builds on the run's
    # shared Ray head, not on a local Ray of its own (~15 s and 10-25 CPU-seconds of Ray's
    # daemons): `loomax train` starting a local Ray is test_ray_cluster.py's test
    cmd = [
        sys.executable,
        "-m",
        "loomax.cli",
        "train",
        "--config_path",
        str(repo_root / "config" / "quickstart.yaml"),
        "--data.train",
        '[{"embedded": "python_stdlib", "max_documents": 200}]',
        "--trainer.num_train_steps",
        "4",
        "--trainer.train_batch_size",
        "8",
        "--trainer.steps_per_eval",
        "4",
        "--trainer.max_eval_batches",
        "2",
        "--trainer.run_dir",
        str(tmp_path / "run"),
        "--data.cache_dir",
        str(repo_root / ".cache" / "quickstart-data"),
        "--sample.max_new_tokens",
        "8",
        "--trainer.ray.address",
        ray_cluster.address,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval loss: step 0:" in proc.stdout and "-> step 4:" in proc.stdout
    # the demo's bar: gzip -9 on the same held-out files, beside the model's bits per byte
    assert re.search(r"held-out bits per byte: [\d.]+ \(model\) vs [\d.]+ \(gzip -9", proc.stdout)
    assert "sample:" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "steps: 4 of 4"  # the last line: how many steps ran
    assert "train: 100%" in proc.stderr  # the progress bar
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 4 and "eval/loss" in records[-1] and "train/loss" in records[-1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trainer.initialize_from"], "trainer.initialize_from: no complete checkpoint at"),
        (["--trainer.initialize_from_hf"], "trainer.initialize_from_hf: .*no config.json"),
        (
            ["--trainer.load_checkpoint", "true", "--trainer.load_checkpoint_path"],
            "trainer.load_checkpoint is true but there is no complete checkpoint at",
        ),
    ],
)
def test_missing_weights_fail_before_the_data_is_built(tmp_path, tiny_corpus, flags, message):
    config = small_config(
        tmp_path, tiny_corpus, *flags, str(tmp_path / "nowhere"), cache=tmp_path / "cache"
    )
    with pytest.raises(FileNotFoundError, match=message):
        train_lm(config)
    assert not (tmp_path / "cache").exists()  # no tokenizer trained, no cache written


def test_a_data_path_that_matches_nothing_names_its_config_key(tmp_path, tiny_corpus):
    missing = json.dumps([{"urls": [str(tiny_corpus)]}, {"urls": [str(tmp_path / "no/*.txt")]}])
    config = small_config(
        tmp_path, tiny_corpus, "--data.validation", missing, cache=tmp_path / "cache"
    )
    with pytest.raises(FileNotFoundError) as error:
        train_lm(config)
    assert str(error.value).startswith(
        f"data.validation[1].urls: no files match {tmp_path}/no/*.txt;"
    )
    assert not (tmp_path / "cache").exists()  # before any tokenizer or cache


@pytest.mark.slow
def test_a_step_that_will_not_fit_ends_in_one_line_before_training(
    tmp_path, tiny_corpus, cache, monkeypatch, capsys
):
    from loomax.cli import main
    from loomax.train import memory_fit

    monkeypatch.setattr(memory_fit, "host_available_bytes", lambda: 2**20)  # 1 MiB of RAM left
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *small_args(tmp_path, tiny_corpus, cache=cache)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert err[-1].startswith(
        "loomax train: error: the train step will not fit in memory: it needs"
    )
    assert "this host has 0.00 GiB of RAM available" in err[-1]
    assert not list((tmp_path / "run").rglob("step-*"))  # no step taken, nothing saved
    # overridable: trainer.check_memory false tries anyway (here, it fits after all)
    result = train_lm(
        small_config(
            tmp_path,
            tiny_corpus,
            "--trainer.check_memory",
            "false",
            "--trainer.num_train_steps",
            "1",
            "--trainer.eval_at_start",
            "false",
            "--sample.enabled",
            "false",
            cache=cache,
        )
    )
    assert result.final.step == 1


def test_fp8_without_fp8_devices_fails_before_the_data_is_built(tmp_path, tiny_corpus):
    config = small_config(tmp_path, tiny_corpus, "--model.fp8", "on", cache=tmp_path / "cache")
    with pytest.raises(ConfigError, match="model.fp8: on needs FP8 matmuls"):
        train_lm(config)
    assert not (tmp_path / "cache").exists()


def test_eval_batch_must_split_over_data_parallel_devices(tmp_path, tiny_corpus, cache):
    from loomax.data import build_lm_datasets
    from loomax.lm import eval_sets

    config = small_config(tmp_path, tiny_corpus, cache=cache)
    data = build_lm_datasets(config.data, config.model.seq_len)
    whole = eval_sets(config, data, 2)[0]
    assert whole.shape[0] == 8  # one process holds all 8 rows
    second = eval_sets(config, data, 2, rows=(1, 2))[0]  # row block 1 of 2 (MeshRuntime.row_block)
    assert (second == whole[4:]).all()
    with pytest.raises(ValueError, match=r"trainer.eval_batch_size to a multiple of 3"):
        eval_sets(config, data, 3)


def test_eval_budget_in_tokens_and_eval_microbatches_must_divide(tmp_path, tiny_corpus, cache):
    from loomax.data import build_lm_datasets
    from loomax.lm import eval_sets

    config = small_config(tmp_path, tiny_corpus, "--trainer.max_eval_batches", "null", cache=cache)
    data = build_lm_datasets(config.data, config.model.seq_len)
    assert len(eval_sets(config, data, 1)) >= 3  # enough batches for the budget to bite
    for tokens, batches in [("600", 2), ("100", 1)]:  # 256 tokens a batch; at least one
        budget = small_config(
            tmp_path, tiny_corpus, "--trainer.max_eval_tokens", tokens, cache=cache
        )
        assert len(eval_sets(budget, data, 1)) == batches
    both = small_config(
        tmp_path,
        tiny_corpus,
        "--trainer.max_eval_tokens",
        "2000",
        "--trainer.max_eval_batches",
        "1",
        cache=cache,
    )
    assert len(eval_sets(both, data, 1)) == 1  # the smaller limit wins
    micro = small_config(
        tmp_path, tiny_corpus, "--trainer.per_device_eval_parallelism", "3", cache=cache
    )
    with pytest.raises(ValueError, match=r"trainer.per_device_eval_parallelism \(3\) must divide"):
        eval_sets(micro, data, 1)
    micro = small_config(
        tmp_path, tiny_corpus, "--trainer.per_device_eval_parallelism", "2", cache=cache
    )
    assert eval_sets(micro, data, 2)[0].shape[0] == 8  # 2 devices x 2 rows divide 8
    for key, value in [("max_eval_tokens", "0"), ("per_device_eval_parallelism", "0")]:
        with pytest.raises(ValueError, match=f"trainer.{key} must be"):
            small_config(tmp_path, tiny_corpus, f"--trainer.{key}", value, cache=cache)


def test_eval_only_cli_prints_the_eval_and_trains_nothing(tmp_path, tiny_corpus, cache, capsys):
    from loomax.cli import main

    main(["train", *small_args(tmp_path, tiny_corpus, "--trainer.eval_only", "true", cache=cache)])
    out = capsys.readouterr().out
    # the run's first line says where it runs
    assert out.splitlines()[0] == (
        "devices: 1 x cpu in 1 process; mesh replica=1 data=1 expert=1 context=1 model=1 "
        "stage=1 (trainer.mesh)"
    )
    assert "eval loss: step 0:" in out and "-> step 0:" in out
    assert out.splitlines()[-1] == "steps: 0 of 40 (trainer.eval_only: evaluated, not trained)"
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] and "eval/loss" in records[0]
    assert "train/loss" not in records[0]
