"""The demo's bar: gzip -9 on the held-out documents, picked as the token cache picks them."""

import gzip

from loomax.data import DataConfig, SourceConfig
from loomax.data.gzip_baseline import gzip_bits_per_byte, held_out_documents
from loomax.data.run_tokenizer import tokenizer_documents
from loomax.data.sources import iter_documents


def test_held_out_documents_are_those_the_train_split_leaves_out() -> None:
    source = SourceConfig(embedded="python_stdlib", max_documents=100)
    config = DataConfig(train=[source], validation_fraction=0.2)
    held = held_out_documents(config)
    kept = list(tokenizer_documents(config))
    assert 5 < len(held) < 40
    assert sorted(held + kept) == sorted(iter_documents(source))
    given = DataConfig(train=[source], validation=[source])  # validation sources: nothing held out
    assert held_out_documents(given) == []


def test_gzip_bits_per_byte_compresses_each_document_alone() -> None:
    docs = ["def f(x):\n    return x\n" * 50, "é" * 300]
    raw = sum(len(d.encode()) for d in docs)
    packed = sum(len(gzip.compress(d.encode(), 9)) for d in docs)
    assert gzip_bits_per_byte(docs) == 8 * packed / raw
    assert gzip_bits_per_byte(docs) < 1.0  # repetitive text compresses well
    assert gzip_bits_per_byte([]) is None and gzip_bits_per_byte([""]) is None
