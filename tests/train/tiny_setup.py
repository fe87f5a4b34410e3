"""A tiny GPT-2 trainer setup shared by the hook tests (same shapes, so compiles are cached).

Loaded by tests/conftest.py as the ``tiny`` fixture.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from loomax.lm import lm_loss
from loomax.models import Gpt2Config
from loomax.optim import AdamConfig
from loomax.tracking import JsonlTrackerConfig
from loomax.train import Trainer, TrainerConfig

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=2)
VOCAB = 48
SPIKE = -2
"""A batch whose first token is this has its loss multiplied by 30 (see ``spiking_loss``)."""


class Tiny:
    """Builds trainers, batches and states of one tiny model."""

    spiking_loss = staticmethod(lambda: spiking_loss())

    model = MODEL
    vocab = VOCAB

    @staticmethod
    def trainer(tmp_path, steps=6, loss_fn=None, **overrides) -> Trainer:
        overrides.setdefault("tracker", JsonlTrackerConfig())
        config = TrainerConfig(
            num_train_steps=steps,
            train_batch_size=4,
            run_dir=str(tmp_path / "run"),
            progress_bar=False,
            **overrides,
        )
        opt = AdamConfig(learning_rate=1e-3, warmup=0, lr_schedule="constant")
        return Trainer(
            config, opt.build(steps), loss_fn or lm_loss(), lr_schedule=opt.lr_scheduler(steps)
        )

    @staticmethod
    def batches(seed=0, spike_at=()):
        """Random token batches; batch i (from 0) in ``spike_at`` is marked to spike the loss."""
        rng = np.random.default_rng(seed)
        i = 0
        while True:
            b = rng.integers(0, VOCAB, (4, MODEL.seq_len), dtype=np.int32)
            if i in spike_at:
                b[0, 0] = SPIKE
            yield b
            i += 1

    @staticmethod
    def init(trainer):
        return trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))


def spiking_loss():
    """The LM loss, times 30 on batches marked by ``Tiny.batches(spike_at=...)``."""
    base = lm_loss()

    def loss_fn(model, tokens, *, key=None):
        (total, weight), _ = base(model, jnp.maximum(tokens, 0), key=key)
        return total * jnp.where(tokens[0, 0] == SPIKE, 30.0, 1.0), weight

    return loss_fn
