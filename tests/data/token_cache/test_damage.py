"""Damaged token-cache files are found and rebuilt where that is safe, or refused in one
line naming the file and the fix; a damaged byte is never read as a token.

Builds run in this process (Ray is patched out: `tasks.build_piece` runs here, as for a
`memory://` cache), into real local files under tmp_path, which the tests then truncate,
overwrite or delete.
"""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loomax.data.sources import SourceConfig, source_shards
from loomax.data.token_cache import (
    TokenCache,
    TokenCacheDamaged,
    TokenCacheError,
    assemble,
    build,
    build_token_cache,
    finish,
    layout,
)
from loomax.data.tokenizer import train_bpe_tokenizer

FIX = "and rerun `loomax cache`"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three small .jsonl shards and a BPE tokenizer of them."""
    root = tmp_path_factory.mktemp("corpus")
    texts = []
    for k in range(3):
        shard = [f"shard {k}, doc {i}: " + "héllo wörld, " * (i % 5) for i in range(12)]
        (root / f"s{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in shard))
        texts += shard
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(texts, 300, tokenizer)
    return SimpleNamespace(
        root=root, shards=source_shards(SourceConfig(urls=[str(root / "s{0..2}.jsonl")])),
        tokenizer=tokenizer,
    )  # fmt: skip


def without_ray(patch: pytest.MonkeyPatch) -> None:
    """Runs the build's tasks here instead of on Ray (the Ray path is tested elsewhere)."""
    patch.setattr(build, "ray_session", lambda config: nullcontext())
    patch.setattr(build, "_run_on_ray", build._run_here)


@pytest.fixture(autouse=True)
def in_this_process(monkeypatch):
    without_ray(monkeypatch)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """What an undamaged cache holds: meta, and tokens and offsets of both splits."""
    path = tmp_path_factory.mktemp("reference") / "cache"
    with pytest.MonkeyPatch.context() as patch:
        without_ray(patch)
        make(corpus, path)
    return contents(path)


def make(corpus, path: Path, **kwargs):
    return build_token_cache(
        corpus.shards, corpus.tokenizer, path, holdout_fraction=0.3, progress=False, **kwargs
    )


def contents(path: Path) -> dict:
    cache = TokenCache.open(path)
    return {
        "meta": cache.meta,
        **{f"{s}/tokens": cache[s].as_numpy() for s in cache.splits},
        **{f"{s}/offsets": cache[s].offsets() for s in cache.splits},
    }


def assert_like(path: Path, reference: dict) -> None:
    got = contents(path)
    assert got.keys() == reference.keys() and got["meta"] == reference["meta"]
    for key in reference:
        if key != "meta":
            np.testing.assert_array_equal(got[key], reference[key])


def one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------- a finished cache
@pytest.mark.parametrize(
    "damage, found",
    [
        (
            "truncate train/tokens/c/0",
            r"train/tokens/c/0 has [\d,]+ bytes, [\d,]+ when it was written",
        ),
        ("delete validation/offsets/c/0", "validation/offsets/c/0 is missing"),
        ("delete train/tokens/zarr.json", "train/tokens/zarr.json is missing"),
    ],
)
def test_a_truncated_or_deleted_file_is_refused_on_open_and_rebuilt(
    corpus, reference, tmp_path, damage, found, caplog
):
    cache = tmp_path / "cache"
    make(corpus, cache)
    action, name = damage.split()
    file = cache / name
    if action == "truncate":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else:
        file.unlink()
    with pytest.raises(TokenCacheDamaged, match=found) as error:
        TokenCache.open(cache)
    assert f"delete {cache} {FIX}" in one_line(error.value)

    with caplog.at_level(logging.WARNING):
        info = make(corpus, cache)
    assert (
        info.shards_tokenized == 3 and "is damaged" in caplog.text and "rebuilding" in caplog.text
    )
    assert_like(cache, reference)


def test_every_overwritten_byte_fails_the_read_and_none_is_read_as_tokens(
    corpus, tmp_path, monkeypatch
):
    """The size stays, so only the checksums can tell: each byte of a token file, flipped in
    turn, makes the read fail (a missed one would have been read as tokens)."""
    monkeypatch.setattr(layout, "SHARD_TOKENS", 256)  # small files of 4 chunks each
    monkeypatch.setattr(layout, "READ_CHUNK", 64)
    cache = tmp_path / "cache"
    make(corpus, cache)
    assert len(list((cache / "train" / "tokens" / "c").iterdir())) > 1
    file = cache / "train" / "tokens" / "c" / "0"
    good = file.read_bytes()
    assert len(good) > 4 * 64  # four chunks of 64 tokens and an index, compressed
    for position in range(len(good)):
        file.write_bytes(good[:position] + bytes([good[position] ^ 0x5A]) + good[position + 1 :])
        split = TokenCache.open(cache)["train"]  # sizes match: opens
        with pytest.raises(TokenCacheDamaged, match=f"train/tokens is damaged .*{file}") as error:
            split.as_numpy()
        assert f"delete {cache} {FIX}" in one_line(error.value), position
    file.write_bytes(good)
    TokenCache.open(cache)["train"].as_numpy()


def test_a_damaged_cache_that_a_run_reads_is_rebuilt_before_training(corpus, tmp_path, caplog):
    """`build_lm_datasets` reads a small cache whole: an overwritten byte (same size, so the
    build finds the cache whole) fails that read, and the cache is rebuilt from its sources."""
    from loomax.data import DataConfig, build_lm_datasets

    config = DataConfig(
        train=[SourceConfig(urls=[str(corpus.root / "s{0..2}.jsonl")])],
        tokenizer=str(corpus.tokenizer), cache_dir=str(tmp_path), validation_fraction=0.3,
    )  # fmt: skip
    first = build_lm_datasets(config, seq_len=8)
    [url] = first.caches[:1]
    file = Path(url.removeprefix("file://")) / "train" / "tokens" / "c" / "0"
    data = bytearray(file.read_bytes())
    data[len(data) // 3] ^= 0xFF
    file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        second = build_lm_datasets(config, seq_len=8)
    assert "train/tokens is damaged" in caplog.text and "rebuilding it" in caplog.text
    np.testing.assert_array_equal(
        second.train[0].get_batch(np.arange(len(first.train[0]))),
        first.train[0].get_batch(np.arange(len(first.train[0]))),
    )


def test_a_damaged_meta_json_is_rebuilt_or_refused(corpus, reference, tmp_path):
    cache = tmp_path / "cache"
    make(corpus, cache)
    (cache / "meta.json").write_text('{"format": 3, "splits": {"tr')
    with pytest.raises(TokenCacheDamaged, match=rf"{cache / 'meta.json'} is damaged \(not JSON\)"):
        TokenCache.open(cache)
    assert make(corpus, cache).shards_tokenized == 3  # build.json names these settings
    assert_like(cache, reference)

    (cache / "meta.json").write_bytes(b"\x00" * 40)
    (cache / "build.json").write_bytes(b"\xff" * 40)  # whose cache it was is unknown
    with pytest.raises(TokenCacheDamaged, match="meta.json is damaged") as error:
        make(corpus, cache)
    assert f"delete {cache} {FIX}" in one_line(error.value)


def test_a_deleted_meta_json_or_ledger_is_rebuilt(corpus, reference, tmp_path):
    cache = tmp_path / "cache"
    make(corpus, cache)
    shutil.rmtree(cache / "ledger")
    assert_like(cache, reference)  # finished: the ledger is no longer read
    (cache / "meta.json").unlink()
    with pytest.raises(TokenCacheError, match="has no meta.json"):
        TokenCache.open(cache)
    assert make(corpus, cache).shards_tokenized == 3
    assert_like(cache, reference)
    (cache / "meta.json").unlink()  # with the ledger, whose pieces are deleted: retokenized
    assert make(corpus, cache).shards_tokenized == 3
    assert_like(cache, reference)


# ---------------------------------------------------------------------- a stopped build
class Killed(BaseException):
    """The build's process dies here (nothing after it runs, no `except Exception` sees it)."""


def kill_on_shard(name: str):
    def before_piece(shard) -> None:
        if shard.name == name:
            raise Killed

    return before_piece


def test_a_build_stopped_at_any_point_resumes_to_the_same_cache(
    corpus, reference, tmp_path, monkeypatch
):
    points = {}
    cache = tmp_path / "tokenizing"  # two shards recorded, the third never
    with pytest.raises(Killed):
        make(corpus, cache, before_piece=kill_on_shard(corpus.shards[2].name))
    points["tokenizing"] = cache

    real_create = assemble.create_array
    calls = []

    def create_then_die(directory, dtype, size):  # the tokens written, then killed
        calls.append(directory)
        if len(calls) == 2:
            raise Killed
        return real_create(directory, dtype, size)

    cache = tmp_path / "assembling"
    with monkeypatch.context() as patch:
        patch.setattr(assemble, "create_array", create_then_die)
        with pytest.raises(Killed):
            make(corpus, cache)
    points["assembling"] = cache

    def delete_some(root):  # meta.json written, one piece deleted, then killed
        shutil.rmtree(Path(root.url.removeprefix("file://")) / "pieces" / "0")
        raise Killed

    cache = tmp_path / "deleting"
    with monkeypatch.context() as patch:
        patch.setattr(finish, "delete_pieces", delete_some)
        with pytest.raises(Killed):
            make(corpus, cache)
    points["deleting"] = cache

    for point, cache in points.items():
        make(corpus, cache)
        assert_like(cache, reference), point
        assert not (cache / "pieces").exists(), point


def test_damaged_build_records_and_lost_pieces_are_mended(corpus, reference, tmp_path):
    """A stopped build whose build.json and first ledger entry do not parse, and whose second
    shard's piece lost a file: the entries' own fingerprints say what they belong to."""
    cache = tmp_path / "cache"
    with pytest.raises(Killed):
        make(corpus, cache, before_piece=kill_on_shard(corpus.shards[2].name))
    (cache / "build.json").write_bytes(b"\x00" * 10)
    (cache / "ledger" / "0.json").write_text('{"position": 0, "na')  # cut short
    entry = json.loads((cache / "ledger" / "1.json").read_text())
    shutil.rmtree(cache / "pieces" / "1" / entry["piece"] / "train" / "offsets")
    assert make(corpus, cache).shards_tokenized == 3
    assert_like(cache, reference)


def test_a_damaged_piece_met_in_assembly_is_refused_in_one_line(corpus, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(Killed):
        make(corpus, cache, before_piece=kill_on_shard(corpus.shards[2].name))
    entry = json.loads((cache / "ledger" / "1.json").read_text())
    chunk = cache / "pieces" / "1" / entry["piece"] / "train" / "tokens" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(TokenCacheDamaged, match=f"a piece under {cache / 'pieces'} is damaged"):
        make(corpus, cache)


# ---------------------------------------------------------------------- damaged inputs
def damaged_sources(directory: Path) -> dict[str, tuple[Path, str]]:
    """A truncated .jsonl.gz, a truncated parquet file and a .jsonl with a bad line, each
    with what the error says about it."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(200)]
    lines = "".join(records)
    gz = directory / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(lines.encode(), mtime=0)[:-40])
    parquet = directory / "cut.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(100)]}), parquet)
    parquet.write_bytes(parquet.read_bytes()[:-20])
    bad = directory / "bad.jsonl"
    bad.write_text("".join(records[:3]) + '{"text": "cut\n' + "".join(records[3:]))
    return {
        "truncated-gzip": (gz, r"cut\.jsonl\.gz: cannot read after line \d+ .*: replace it"),
        "truncated-parquet": (parquet, r"cut\.parquet: not a readable parquet file .*: replace it"),
        "bad-json-line": (bad, r"bad\.jsonl, line 4: invalid JSON .*skip_bad_records: true"),
    }


@pytest.mark.parametrize("kind", ["truncated-gzip", "truncated-parquet", "bad-json-line"])
def test_a_damaged_source_file_is_named_by_the_tokenizer_pass_and_the_build(corpus, tmp_path, kind):
    from loomax.data import DataConfig
    from loomax.data.run_tokenizer import prepare_tokenizer
    from loomax.errors import UserError

    path, said = damaged_sources(tmp_path)[kind]
    config = DataConfig(
        train=[SourceConfig(urls=[str(path)])], cache_dir=str(tmp_path / "c"),
        tokenizer_vocab_size=300,
    )  # fmt: skip
    with pytest.raises(UserError, match=said) as error:
        prepare_tokenizer(config)
    one_line(error.value)
    with pytest.raises(TokenCacheError, match=said) as error:
        build_token_cache(source_shards(config.train[0]), corpus.tokenizer, tmp_path / "cache")
    one_line(error.value)
    assert not (tmp_path / "cache" / "meta.json").exists()


def test_a_damaged_trained_tokenizer_is_trained_again(corpus, tmp_path, caplog):
    from loomax.data import DataConfig
    from loomax.data.run_tokenizer import prepare_tokenizer

    config = DataConfig(
        train=[SourceConfig(urls=[str(corpus.root / "s{0..2}.jsonl")])],
        cache_dir=str(tmp_path), tokenizer_vocab_size=300,
    )  # fmt: skip
    path = prepare_tokenizer(config)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with caplog.at_level(logging.WARNING):
        assert prepare_tokenizer(config) == path
    assert f"{path} is damaged: training it again" in caplog.text
    assert path.read_bytes() == good


def test_loomax_cache_on_a_damaged_cache_ends_in_one_line(corpus, tmp_path):
    """`loomax cache` as a process: a cache whose meta.json and build.json are both damaged
    (whose settings it held is unknown) is refused in one line naming the file and the fix."""
    import subprocess
    import sys

    from loomax.data import DataConfig
    from loomax.data.dataset import build_caches

    source = {"urls": [str(corpus.root / "s{0..2}.jsonl")]}
    config = DataConfig(
        train=[SourceConfig(**source)], tokenizer=str(corpus.tokenizer), cache_dir=str(tmp_path)
    )
    [info], _ = build_caches(config, corpus.tokenizer, progress=False)
    cache = Path(info.url.removeprefix("file://"))
    (cache / "meta.json").write_bytes(b"\x00" * 64)
    (cache / "build.json").write_text("{")
    proc = subprocess.run(
        [sys.executable, "-m", "loomax.cli", "cache", "--data.train", json.dumps([source]),
         "--data.tokenizer", str(corpus.tokenizer), "--data.cache_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if "error" in x]
    assert line == (
        f"loomax cache: error: token cache: {cache / 'meta.json'} is damaged (not JSON); "
        f"delete {cache} {FIX} (or `loomax train`, which rebuilds a damaged cache it finds "
        "before training)"
    )


def test_an_array_of_another_shape_is_refused_where_no_sizes_are_recorded(corpus, tmp_path):
    """memory:// (like gs://) lists no sizes: a `zarr.json` rewritten with another shape is
    found by its shape, against meta.json's count."""
    from loomax.storage import Directory

    url = f"memory://{tmp_path.name}-shape"
    make(corpus, url)
    assert set(TokenCache.open(url).meta["files"].values()) == {None}
    tokens = Directory(url).child("train", "tokens")
    metadata = tokens.read_json("zarr.json")
    metadata["shape"] = [metadata["shape"][0] - 5]
    tokens.write_json("zarr.json", metadata)
    with pytest.raises(TokenCacheDamaged, match=r"train/tokens is damaged \(shape \[\d+\], meta"):
        TokenCache.open(url)["train"]
