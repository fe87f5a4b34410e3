"""Deterministic, step-addressed training batches and fixed eval batches."""

import itertools

import numpy as np
import pytest

from loomax.data import BatchLoader, TokenWindows, eval_batches

SEQ_LEN = 3


def numbered_windows(count: int) -> TokenWindows:
    """Windows whose first token, divided by SEQ_LEN, is the window index."""
    return TokenWindows(np.arange(count * SEQ_LEN, dtype=np.int32), SEQ_LEN)


def window_ids(batch: np.ndarray) -> list[int]:
    return (batch[:, 0] // SEQ_LEN).tolist()


def test_batches_have_the_right_shape_and_content() -> None:
    loader = BatchLoader(numbered_windows(10), batch_size=4, seed=0)
    batch = loader.batch(0)
    assert batch.shape == (4, SEQ_LEN)
    assert batch.dtype == np.int32
    for row in batch:
        assert row.tolist() == list(range(row[0], row[0] + SEQ_LEN))


def test_same_seed_same_batches_different_seed_different() -> None:
    windows = numbered_windows(50)
    first = [BatchLoader(windows, 8, seed=1).batch(s) for s in range(10)]
    again = [BatchLoader(windows, 8, seed=1).batch(s) for s in range(10)]
    other = [BatchLoader(windows, 8, seed=2).batch(s) for s in range(10)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_batch_by_step_matches_iteration() -> None:
    loader = BatchLoader(numbered_windows(7), batch_size=3, seed=5)
    iterated = list(itertools.islice(loader, 12))
    for step, batch in enumerate(iterated):
        assert np.array_equal(loader.batch(step), batch)
    resumed = list(itertools.islice(loader.iter_from(4), 8))
    assert all(np.array_equal(a, b) for a, b in zip(resumed, iterated[4:], strict=True))


@pytest.mark.parametrize(("count", "batch_size"), [(10, 5), (10, 3), (4, 9)])
def test_every_window_once_per_epoch(count: int, batch_size: int) -> None:
    loader = BatchLoader(numbered_windows(count), batch_size, seed=3)
    epochs = 4
    num_steps = -(-epochs * count // batch_size)
    stream = [i for step in range(num_steps) for i in window_ids(loader.batch(step))]
    orders = [stream[e * count : (e + 1) * count] for e in range(epochs)]
    for order in orders:
        assert sorted(order) == list(range(count))
    assert len({tuple(order) for order in orders}) > 1


def test_batch_crosses_the_epoch_boundary() -> None:
    loader = BatchLoader(numbered_windows(10), batch_size=4, seed=9)
    epoch0, epoch1 = loader.epoch_order(0).tolist(), loader.epoch_order(1).tolist()
    assert window_ids(loader.batch(2)) == epoch0[8:10] + epoch1[0:2]
    assert window_ids(loader.batch(3)) == epoch1[2:6]


def test_no_shuffle_reads_in_order() -> None:
    loader = BatchLoader(numbered_windows(5), batch_size=3, seed=0, shuffle=False)
    assert [window_ids(loader.batch(s)) for s in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


def test_invalid_loader_arguments() -> None:
    with pytest.raises(ValueError, match="zero windows"):
        BatchLoader(numbered_windows(0), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(numbered_windows(3), batch_size=0, seed=0)
    with pytest.raises(ValueError, match="step"):
        BatchLoader(numbered_windows(3), batch_size=1, seed=0).batch(-1)


def test_eval_batches_are_sequential_and_drop_the_remainder() -> None:
    batches = eval_batches(numbered_windows(10), batch_size=3, max_batches=None)
    assert [window_ids(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    limited = eval_batches(numbered_windows(10), batch_size=3, max_batches=2)
    assert [window_ids(b) for b in limited] == [[0, 1, 2], [3, 4, 5]]


def test_eval_batches_with_fewer_windows_than_batch_size() -> None:
    batches = eval_batches(numbered_windows(2), batch_size=8, max_batches=5)
    assert len(batches) == 1
    assert window_ids(batches[0]) == [0, 1]
    with pytest.raises(ValueError, match="no validation windows"):
        eval_batches(numbered_windows(0), batch_size=8, max_batches=None)


def test_process_shares_tile_the_global_batch():
    from loomax.data import BatchLoader, TokenWindows

    windows = TokenWindows(np.arange(40 * 4, dtype=np.int32), seq_len=4)
    loader = BatchLoader(windows, batch_size=8, seed=3)
    for step in (0, 7):
        parts = [loader.batch(step, p, 4) for p in range(4)]
        assert all(part.shape == (2, 4) for part in parts)
        np.testing.assert_array_equal(np.concatenate(parts), loader.batch(step))


def test_resume_at_any_step_equals_a_fresh_run() -> None:
    windows = numbered_windows(37)
    fresh = BatchLoader(windows, 8, seed=4)
    stream = [b for _, b in zip(range(12), fresh.iter_from(0), strict=False)]
    resumed = BatchLoader(windows, 8, seed=4).iter_from(7)
    for k in range(7, 12):
        np.testing.assert_array_equal(next(resumed), stream[k])


def test_prefetching_iterator_equals_direct_batches() -> None:
    loader = BatchLoader(numbered_windows(20), 4, seed=1, prefetch=3)
    it = loader.iter_from(5)
    for k in range(5, 15):
        np.testing.assert_array_equal(next(it), loader.batch(k))
    it.close()


def test_a_mixture_reads_each_dataset_by_weight() -> None:
    a = TokenWindows(np.zeros(300 * SEQ_LEN, dtype=np.int32), SEQ_LEN)
    b = TokenWindows(np.ones(300 * SEQ_LEN, dtype=np.int32), SEQ_LEN)
    loader = BatchLoader(
        [a, b], 50, seed=0, weights=[0.8, 0.2], weight_schedule=[(100, [0.2, 0.8])]
    )
    early = np.concatenate([loader.batch(s) for s in range(100)])[:, 0]
    late = np.concatenate([loader.batch(s) for s in range(100, 200)])[:, 0]
    assert abs(early.mean() - 0.2) < 0.02 and abs(late.mean() - 0.8) < 0.02
    rows = [loader.batch(150, p, 5) for p in range(5)]  # process slices tile the batch
    np.testing.assert_array_equal(np.concatenate(rows), loader.batch(150))
