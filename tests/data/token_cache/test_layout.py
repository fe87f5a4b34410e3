"""The token arrays' storage: stored files (zarr3 shards) no larger than their array needs."""

from __future__ import annotations

import uuid

import numpy as np
import tensorstore as ts

from loomax.data.token_cache import layout
from loomax.data.token_cache.layout import READ_CHUNK, SHARD_TOKENS, array_spec, create_array
from loomax.storage import CONTEXT, Directory


def chunks(size: int) -> tuple[int, int]:
    """(elements per stored file, elements per readable chunk) of a new array of `size`."""
    metadata = array_spec("memory://x", "int64", size)["metadata"]
    stored = metadata["chunk_grid"]["configuration"]["chunk_shape"]
    [sharding] = metadata["codecs"]
    return stored[0], sharding["configuration"]["chunk_shape"][0]


def test_a_stored_file_is_no_larger_than_its_array_needs():
    """A piece's offsets (a hundred elements) used to sit in a file of 4M elements whose
    index listed 32,768 chunks: written, and checksummed, for every piece (~0.1 s each)."""
    assert chunks(90) == (128, 128)
    assert chunks(0) == chunks(1) == (1, 1)
    assert chunks(460_000) == (1 << 19, READ_CHUNK)
    assert chunks(SHARD_TOKENS) == chunks(50_000_000) == (SHARD_TOKENS, READ_CHUNK)


def test_arrays_stored_in_larger_files_still_read():
    """Caches written before (every file of SHARD_TOKENS elements) open as they are."""
    url = f"memory://layout-{uuid.uuid4().hex[:8]}"
    old = array_spec(url, "int32", 90)
    old["metadata"]["chunk_grid"]["configuration"]["chunk_shape"] = [SHARD_TOKENS]
    ts.open(old, create=True, context=CONTEXT).result().write(
        np.arange(90, dtype=np.int32)
    ).result()
    np.testing.assert_array_equal(layout.open_array(Directory(url)).read().result(), np.arange(90))
    grown = create_array(Directory(url + "-new"), "int32", 90)
    grown = grown.resize(exclusive_max=[300]).result()  # a piece grown past its first write
    grown[:300].write(np.arange(300, dtype=np.int32)).result()
    np.testing.assert_array_equal(
        layout.open_array(Directory(url + "-new")).read().result(), np.arange(300)
    )
