"""Fixtures of the launch tests that train for real: a tiny model on the tiny corpus."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def data_args(tiny_corpus, tmp_path_factory, build_data) -> list[str]:
    """Overrides for a tiny, fast model on the tiny corpus, with a data cache shared by the
    session, built before the first launch (`build_data`)."""
    cache = tmp_path_factory.mktemp("launch-cache")
    args = [
        "--data.train", json.dumps([{"urls": [str(tiny_corpus)]}]),
        "--data.tokenizer_vocab_size", "300",
        "--data.validation_fraction", "0.1",
        "--data.cache_dir", str(cache),
        "--model.seq_len", "32",
        "--model.hidden_dim", "32",
        "--model.num_layers", "2",
        "--model.num_heads", "2",
        "--trainer.train_batch_size", "8",
        "--trainer.max_eval_batches", "2",
        "--trainer.progress_bar", "false",
        "--trainer.device_peak_flops", "1e11",  # MFU from this peak: no matmul probe per process
        "--trainer.ray.num_cpus", "1",
        "--sample.enabled", "false",
    ]  # fmt: skip
    build_data(REPO / "config" / "quickstart.yaml", *args)
    return args


@pytest.fixture
def launch_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a launched training: offline wandb under tmp_path, a shared JAX cache."""
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": os.environ.get(
            "JAX_COMPILATION_CACHE_DIR", str(REPO / ".cache" / "jax")
        ),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb-dir"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
    }
    env.pop("WANDB_API_KEY", None)
    return env
