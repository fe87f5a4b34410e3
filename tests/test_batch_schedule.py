"""Batch size as a schedule: offsets, the loader following it, the trainer, resume and LR scaling."""

from __future__ import annotations

import tempfile

import jax
import numpy as np
import pytest

from loomax.batch_schedule import BatchSchedule, BatchStage
from loomax.config import parse_config
from loomax.data import BatchLoader, TokenWindows
from loomax.lm import TrainLmConfig, lm_loss
from loomax.mesh import MeshConfig
from loomax.models import Gpt2Config
from loomax.optim import AdamConfig
from loomax.tracking import NoopTrackerConfig
from loomax.train import Trainer, TrainerConfig

STAGES = [BatchStage(0, 4), BatchStage(3, 8), BatchStage(5, 2)]


def test_offsets_are_sums_of_earlier_batch_sizes():
    s = BatchSchedule(STAGES)
    assert [s.size_at(k) for k in range(7)] == [4, 4, 4, 8, 8, 2, 2]
    assert [s.offset(k) for k in range(8)] == [0, 4, 8, 12, 20, 28, 30, 32]
    assert all(s.step_of_offset(s.offset(k)) == k for k in range(20))
    assert BatchSchedule(16).offset(10) == 160 and BatchSchedule(16).is_constant


@pytest.mark.parametrize(
    "stages, match",
    [
        ([BatchStage(1, 4)], "first stage must start at step 0"),
        ([BatchStage(0, 4), BatchStage(0, 8)], "must increase"),
        ([BatchStage(0, 0)], "positive"),
        ([], "non-empty"),
    ],
)
def test_bad_schedules(stages, match):
    with pytest.raises(ValueError, match=match):
        BatchSchedule(stages)
    with pytest.raises(ValueError, match="trainer.train_batch_size"):
        TrainerConfig(train_batch_size=stages)


def test_parsed_from_yaml_syntax():
    config = parse_config(
        TrainLmConfig,
        None,
        ["--trainer.train_batch_size", "[{start: 0, value: 256}, {start: 1000, value: 512}]"],
    )
    assert config.trainer.batch_schedule.offset(1001) == 1000 * 256 + 512


def windows(n=50, seq_len=16):
    tokens = np.random.default_rng(0).integers(0, 64, n * seq_len, dtype=np.int32)
    return TokenWindows(tokens, seq_len)


def test_loader_follows_the_schedule_exactly():
    data = windows()
    scheduled = BatchLoader(data, BatchSchedule(STAGES), seed=3, prefetch=0)
    one_by_one = BatchLoader(data, 1, seed=3, prefetch=0)
    stream = np.concatenate([scheduled.batch(k) for k in range(30)])  # wraps several epochs
    expected = np.concatenate([one_by_one.batch(p) for p in range(len(stream))])
    np.testing.assert_array_equal(stream, expected)
    assert [len(scheduled.batch(k)) for k in (0, 3, 5)] == [4, 8, 2]
    resumed = next(scheduled.iter_from(4))  # O(1) resume at any step
    np.testing.assert_array_equal(resumed, scheduled.batch(4))
    half = scheduled.batch(3, process_index=1, process_count=2)
    np.testing.assert_array_equal(half, scheduled.batch(3)[4:])


MODEL = Gpt2Config(
    seq_len=16,
    hidden_dim=32,
    num_layers=2,
    num_heads=4,
    gradient_checkpointing=False,
    cross_entropy_block_size=None,
)


def make_trainer(steps, run_dir, **settings):
    config = TrainerConfig(
        num_train_steps=steps,
        train_batch_size=[BatchStage(0, 4), BatchStage(3, 8)],
        per_device_parallelism=4,  # 8-sequence steps accumulate 2 microbatches
        mesh=MeshConfig(1, 1, 1),
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=run_dir,
        **settings,
    )
    optimizer = AdamConfig(learning_rate=1e-2, warmup=0, scale_lr_with_batch="sqrt")
    return Trainer(
        config,
        optimizer.build(6, config.batch_schedule),
        lm_loss(),
        lr_schedule=optimizer.lr_scheduler(6, config.batch_schedule),
        devices=jax.devices()[:1],
    )


def train(trainer, loader, seen):
    state = trainer.initial_state(lambda key: MODEL.build(64, key=key))
    trainer.add_hook(lambda info: seen.append((info.step, info.metrics["optim/learning_rate"])))

    def batches():
        for batch in loader.iter_from(int(state.step)):
            seen.append(("rows", len(batch)))
            yield batch

    final = trainer.train(state, batches())
    trainer.finish()
    return final.state


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]


@pytest.mark.slow
def test_trainer_steps_follow_the_schedule_and_resume_bitwise():
    loader = BatchLoader(windows(), BatchSchedule([BatchStage(0, 4), BatchStage(3, 8)]), seed=0)
    seen: list = []
    full = train(make_trainer(6, tempfile.mkdtemp()), loader, seen)
    rows = [n for tag, n in seen if tag == "rows"][:6]
    assert rows == [4, 4, 4, 8, 8, 8]
    # the metric at step s is the LR of batch s - 1: cosine to 0.1, times sqrt(8 / 4) from batch 3 on
    lrs = {step: float(lr) for step, lr in seen if step != "rows"}
    cosine = [1e-2 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * k / 6))) for k in range(6)]
    assert lrs[3] == pytest.approx(cosine[2])
    assert lrs[4] == pytest.approx(cosine[3] * np.sqrt(2))
    assert lrs[6] == pytest.approx(cosine[5] * np.sqrt(2))

    run_dir = tempfile.mkdtemp()
    train(make_trainer(4, run_dir), loader, [])  # stops after step 4 with a checkpoint
    resumed = train(make_trainer(6, run_dir, load_checkpoint=True), loader, [])
    for a, b in zip(leaves(full), leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_batch_size_schedule_hook_logs_consumed_data():
    from loomax.hooks.batch_size import BatchSizeScheduleHook

    hook = BatchSizeScheduleHook(schedule=BatchSchedule(STAGES), seq_len=16)
    assert hook.values(4) == {"data/batch_size": 8, "data/sequences": 20, "data/tokens": 320}
    assert hook.values(6)["data/batch_size"] == 2


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_train_lm_with_a_batch_size_schedule_from_yaml(tmp_path, tiny_corpus):
    import json

    from loomax.train_lm import train_lm

    run_dir = tmp_path / "run"
    args = {
        "--data.train": json.dumps([{"urls": [str(tiny_corpus)]}]),
        "--data.tokenizer_vocab_size": "300",
        "--data.cache_dir": str(tmp_path / "cache"),
        "--model.seq_len": "32",
        "--model.hidden_dim": "32",
        "--model.num_layers": "2",
        "--model.num_heads": "2",
        "--trainer.train_batch_size": "[{start: 0, value: 4}, {start: 3, value: 16}]",
        "--trainer.num_train_steps": "6",
        "--trainer.log_every": "1",
        "--trainer.eval_at_start": "false",
        "--trainer.max_eval_batches": "1",
        "--trainer.progress_bar": "false",
        "--trainer.run_dir": str(run_dir),
        "--trainer.hooks": "[{type: batch_size_schedule}]",
        "--optimizer.scale_lr_with_batch": "sqrt",
        "--optimizer.lr_schedule": "constant",
        "--optimizer.warmup": "0",
        "--sample.enabled": "false",
    }
    config = parse_config(TrainLmConfig, None, [x for kv in args.items() for x in kv])
    train_lm(config)
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(record)
    assert [records[s]["data/batch_size"] for s in range(1, 7)] == [4, 4, 4, 16, 16, 16]
    assert records[6]["data/sequences"] == 3 * 4 + 3 * 16
    # the built-in throughput follows the schedule too (32 tokens per sequence)
    assert [records[s]["throughput/tokens"] for s in (2, 3, 4, 6)] == [
        32 * n for n in (8, 12, 28, 60)
    ]
    lr = config.optimizer.learning_rate
    assert records[3]["optim/learning_rate"] == pytest.approx(lr)
    assert records[4]["optim/learning_rate"] == pytest.approx(2 * lr)  # sqrt(16 / 4)
    assert "eval/loss" in records[6]
