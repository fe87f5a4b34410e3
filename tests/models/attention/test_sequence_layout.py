"""Positions within each packed document (``model.document_positions``)."""

from __future__ import annotations

import haliax as hax
import jax.numpy as jnp
import numpy as np

from loomax.models.attention.attention import segment_ids_from_eos
from loomax.models.attention.sequence_layout import document_positions, token_positions
from loomax.models.axes import Batch, Position


def test_positions_restart_at_each_document():
    seg = np.array([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]], np.int32)
    named = hax.named(jnp.asarray(seg), (Batch, Position))
    np.testing.assert_array_equal(
        document_positions(named).array, [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    )
    # pretraining's documents: an EOS (here 9) closes its own document
    tokens = hax.named(jnp.asarray([[5, 6, 9, 7, 9, 8, 8, 8]]), (Batch, Position))
    np.testing.assert_array_equal(
        document_positions(segment_ids_from_eos(tokens, 9)).array, [[0, 1, 2, 0, 1, 0, 1, 2]]
    )
    Pos = named.resolve_axis(Position)
    np.testing.assert_array_equal(token_positions(Pos, named, False).array, np.arange(8))
    np.testing.assert_array_equal(token_positions(Pos, None, True).array, np.arange(8))
