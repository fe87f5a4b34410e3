"""A tiny random Llama and a small byte-level BPE, and tiny lm-eval tasks over local JSONL
files (nothing is downloaded: lm-eval reads them with the `json` dataset builder)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from loomax.data.tokenizer import train_bpe_tokenizer
from loomax.models import Gpt2Config, LlamaConfig

CORPUS = [
    "The cat sat on the mat. The dog sat on the log.",
    "Paris is the capital of France. Rome is the capital of Italy.",
    "One plus one is two. Two plus two is four.",
    "Water is wet and fire is hot; ice is cold.",
] * 5

MC = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "sky"], "answer": 0},
    {"question": "Paris is the capital of", "choices": ["Italy", "France"], "answer": 1},
    {"question": "Two plus two is", "choices": ["four", "five", "one"], "answer": 0},
    {"question": "Fire is", "choices": ["cold", "hot"], "answer": 1},
    {"question": "Ice is", "choices": ["cold", "hot", "wet"], "answer": 0},
]
DOCS = [
    {"text": "The dog sat on the log. " * 4},
    {"text": "Rome is the capital of Italy."},
    {"text": "Water is wet. " * 12},
]
QA = [
    {"question": "The cat sat on the", "answer": " mat"},
    {"question": "One plus one is", "answer": " two"},
]


def randomized(config, vocab: int, seed: int = 0):
    """Every weight random (norm scales too), so the log-likelihoods are not uniform."""
    model = config.build(vocab, key=jax.random.PRNGKey(seed))
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [
        x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe_tokenizer(CORPUS, 300, path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    from loomax.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_path)


LLAMA = LlamaConfig(
    seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
)
GPT2 = Gpt2Config(seq_len=32, hidden_dim=32, num_layers=2, num_heads=4)


@pytest.fixture(scope="session")
def llama(tokenizer):
    return randomized(LLAMA, tokenizer.get_vocab_size())


@pytest.fixture(scope="session")
def gpt2(tokenizer):
    return randomized(GPT2, tokenizer.get_vocab_size())


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def tasks_dir(tmp_path_factory) -> Path:
    """``tiny_mc`` (multiple choice), ``tiny_ppl`` (rolling log-likelihood) and ``tiny_gen``
    (generation) as lm-eval task YAMLs over JSONL files next to them."""
    root = tmp_path_factory.mktemp("tasks")

    def data(name, rows):
        return {
            "data_files": {"test": str(_jsonl(root / f"{name}.jsonl", rows))},
            "cache_dir": str(root / "datasets_cache"),  # not ~/.cache
        }

    tasks = {
        "tiny_mc": {
            "dataset_path": "json",
            "dataset_kwargs": data("mc", MC),
            "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
        },
        "tiny_ppl": {
            "dataset_path": "json",
            "dataset_kwargs": data("docs", DOCS),
            "test_split": "test",
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                {"metric": "word_perplexity"},
                {"metric": "byte_perplexity"},
                {"metric": "bits_per_byte"},
            ],
        },
        "tiny_gen": {
            "dataset_path": "json",
            "dataset_kwargs": data("qa", QA),
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{question}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["."], "max_gen_toks": 6, "do_sample": False},
            "metric_list": [{"metric": "exact_match"}],
        },
    }
    for name, body in tasks.items():
        (root / f"{name}.yaml").write_text(json.dumps({"task": name, **body}, indent=1))
    return root
