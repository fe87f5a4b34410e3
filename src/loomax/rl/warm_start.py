"""The warm start: supervised steps on the train prompts' answers before RL, on the same trainer.

The loss is the cross-entropy of the answer tokens (and the closing stop token) after
the prompt; the model it reaches is saved with the tokenizer in ``<run_dir>/warm_start/model``
and read back by a resumed run, so the RL run's reference and starting point stay the same.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from loomax.models.io.saving import load_model
from loomax.rl.config import TrainRlConfig
from loomax.rl.loss import token_logps
from loomax.rl.tasks import Prompt
from loomax.train import Trainer

logger = logging.getLogger(__name__)


def answer_rows(prompts, encode, encode_text, stop: int, seq_len: int) -> dict[str, np.ndarray]:
    """``tokens`` (the prompt as ``encode`` makes it, the answer's ``encode_text`` tokens, the
    stop token) and ``mask`` (the positions predicting the answer and the stop token)."""
    tokens = np.zeros((len(prompts), seq_len), np.int32)
    mask = np.zeros((len(prompts), seq_len), np.float32)
    for i, p in enumerate(prompts):
        prompt, answer = encode(p.prompt), encode_text(p.answer or "") + [stop]
        row = (prompt + answer)[:seq_len]
        tokens[i, : len(row)] = row
        mask[i, len(prompt) - 1 : len(row) - 1] = 1.0
    return {"tokens": tokens, "mask": mask}


def sft_loss(model, batch, *, key=None):
    """Summed answer-token cross-entropy over answer tokens."""
    logp, _ = token_logps(model, batch["tokens"], key=key)
    return jnp.sum(-logp * batch["mask"]), jnp.sum(batch["mask"])


def warm_start_model(
    config: TrainRlConfig,
    prompts: list[Prompt],
    encode,
    encode_text,
    stop: int,
    init,
    run_dir: Path,
    tokenizer,
):
    """The warm-started model (trained now, or read back from ``<run_dir>/warm_start/model``)."""
    steps = config.rl.warm_start_steps
    path = run_dir / "warm_start" / "model"
    if (path / "model.yaml").is_file():
        logger.info("rl: warm-start weights read from %s", path)
        return config.model.for_training(load_model(path))
    trainer_config = dataclasses.replace(
        config.trainer,
        num_train_steps=steps,
        run_dir=str(run_dir / "warm_start"),
        hooks=[],
        steps_per_eval=steps,
        num_train_epochs=None,
    )
    optimizer = dataclasses.replace(
        config.optimizer, learning_rate=config.rl.warm_start_learning_rate
    )
    schedule = trainer_config.batch_schedule
    trainer = Trainer(
        trainer_config, optimizer.build(steps, schedule), sft_loss,
        lr_schedule=optimizer.lr_scheduler(steps, schedule),
    )  # fmt: skip
    rows = answer_rows(prompts, encode, encode_text, stop, config.model.seq_len)
    rng = np.random.default_rng(config.trainer.seed)
    size = schedule.size_at(0)

    def batches():
        while True:
            index = rng.choice(len(prompts), size=size, replace=False)
            yield {k: v[index] for k, v in rows.items()}

    try:
        state = trainer.initial_state(init)
        final = trainer.train(state, batches())
        logger.info("rl: warm start: %d steps, loss %.4f", steps, final.loss)
        model = final.state.model
        model.save(path, tokenizer)
    finally:
        trainer.finish()
    return model
