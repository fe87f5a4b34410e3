"""A tiny random Llama and a small byte-level BPE, and tiny lm-eval tasks over local JSONL
files (tests/support/lm_eval_tasks.py: nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from loomax.data.tokenizer import train_bpe_tokenizer
from loomax.models import Gpt2Config, LlamaConfig


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
def tokenizer_path(tmp_path_factory, lm_eval_tasks) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe_tokenizer(lm_eval_tasks.CORPUS, 300, path)
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


@pytest.fixture(scope="session")
def tasks_dir(tmp_path_factory, lm_eval_tasks) -> Path:
    """``tiny_mc`` (multiple choice), ``tiny_ppl`` (rolling log-likelihood) and ``tiny_gen``
    (generation) as lm-eval task YAMLs over JSONL files next to them."""
    t = lm_eval_tasks
    root = tmp_path_factory.mktemp("tasks")
    t.write_task(root, "tiny_mc", t.MC, data="mc", **t.MULTIPLE_CHOICE)
    ppl = t.rolling("word_perplexity", "byte_perplexity", "bits_per_byte")
    t.write_task(root, "tiny_ppl", t.DOCS, data="docs", **ppl)
    t.write_task(
        root,
        "tiny_gen",
        t.QA,
        data="qa",
        output_type="generate_until",
        doc_to_text="{{question}}",
        doc_to_target="{{answer}}",
        generation_kwargs={"until": ["."], "max_gen_toks": 6, "do_sample": False},
        metric_list=[{"metric": "exact_match"}],
    )
    return root
