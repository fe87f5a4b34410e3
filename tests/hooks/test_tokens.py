"""Token counts for throughput: constant batches and a batch-size schedule."""

from loomax.batch_schedule import BatchSchedule, BatchStage
from loomax.hooks.tokens import token_count, tokens_of_step


def test_an_int_is_that_many_tokens_every_step():
    tokens = token_count(128)
    assert tokens(0) == 0 and tokens(5) == 640
    assert tokens_of_step(tokens, 5) == 128


def test_a_schedule_counts_each_stage_at_its_own_size():
    schedule = BatchSchedule([BatchStage(0, 4), BatchStage(3, 16)])
    tokens = token_count(lambda step: schedule.offset(step) * 32)
    assert [tokens_of_step(tokens, s) for s in (1, 3, 4, 6)] == [128, 128, 512, 512]
    assert tokens(6) == (3 * 4 + 3 * 16) * 32
