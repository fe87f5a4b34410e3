"""The packed-sequence tensors cuDNN's document attention takes, computed from segment ids
(the kernel itself needs a GPU: bench/gpu.py's attention section compares it there)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models import LlamaConfig
from loomax.models.attention.attention import segment_ids_from_eos
from loomax.models.attention.cudnn_packed import document_runs


def test_runs_lengths_and_offsets_per_row():
    seg = jnp.array(
        [
            [0, 0, 0, 1, 1, 2, 2, 2],  # three documents
            [0, 0, 0, 0, 0, 0, 0, 0],  # one
            [5, 5, 7, 7, 5, 5, 5, 5],  # ids need not count up; a returning id is a new run
        ],
        jnp.int32,
    )
    lengths, offsets, runs = document_runs(seg, 4)
    np.testing.assert_array_equal(runs, [3, 1, 3])
    np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1], [2, 2, 4, -1]])
    np.testing.assert_array_equal(
        offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1], [0, 2, 4, -1, -1]]
    )
    assert lengths.dtype == offsets.dtype == jnp.int32


def test_compacted_offsets_pair_with_their_lengths():
    """JAX's cuDNN wrapper keeps only the non-negative entries of all rows, in order, and adds
    each row's start (row * T) to its offsets: the i-th length must then belong to the i-th
    offset, which an end-of-row marker in the offsets would break."""
    seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8, [5, 5, 7, 7, 5, 5, 5, 5]], jnp.int32)
    lengths, offsets, _ = document_runs(seg, 4)
    flat_lengths = [int(x) for x in np.asarray(lengths).ravel() if x >= 0]
    flat_offsets = [
        int(x) + 8 * b for b, row in enumerate(np.asarray(offsets)) for x in row if x >= 0
    ]
    assert list(zip(flat_offsets, flat_lengths, strict=True)) == [
        (0, 3),
        (3, 2),
        (5, 3),
        (8, 8),
        (16, 2),
        (18, 2),
        (20, 4),
    ]


def test_a_row_with_more_documents_than_the_limit_is_counted():
    seg = jnp.arange(8, dtype=jnp.int32)[None]  # eight one-token documents
    lengths, offsets, runs = document_runs(seg, 4)
    assert int(runs[0]) == 8  # > 4: the attention takes the dense-mask branch
    np.testing.assert_array_equal(lengths[0], [1, 1, 1, 1])
    np.testing.assert_array_equal(offsets[0], [0, 1, 2, 3, 4])  # unused: the dense branch runs


def test_segments_from_eos_give_one_run_per_document():
    import haliax as hax

    tokens = hax.named(jnp.array([[3, 9, 4, 4, 9, 9, 2, 1]]), ("batch", "position"))
    seg = segment_ids_from_eos(tokens, 9).array
    lengths, offsets, runs = document_runs(seg, 6)
    # documents end at their EOS: [3 9] [4 4 9] [9] [2 1]
    np.testing.assert_array_equal(lengths[0], [2, 3, 1, 2, -1, -1])
    np.testing.assert_array_equal(offsets[0], [0, 2, 5, 6, -1, -1, -1])


def test_negative_limit_is_a_config_error():
    with pytest.raises(ConfigError, match="model.cudnn_packed_documents"):
        LlamaConfig(cudnn_packed_documents=-1)
