"""Frozen parameters (``trainer.freeze``): no gradient, no update, no optimizer state."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest

from loomax.data import BatchLoader, TokenWindows
from loomax.lm import lm_loss
from loomax.models import Gpt2Config
from loomax.optim import AdamConfig
from loomax.tracking import NoopTrackerConfig
from loomax.train import JitHook, Trainer, TrainerConfig
from loomax.train.step import trainable_mask
from loomax.tree_paths import named_leaves

MODEL = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=2)
VOCAB, BATCH, STEPS = 48, 4, 3


def run(tmp_path, freeze, microbatches=1):
    config = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=BATCH,
        per_device_parallelism=BATCH // microbatches,
        run_dir=str(tmp_path),
        tracker=NoopTrackerConfig(),
        progress_bar=False,
        freeze=freeze,
    )
    opt = AdamConfig(learning_rate=1e-2, warmup=0, weight_decay=0.1)
    trainer = Trainer(config, opt.build(STEPS), lm_loss(), lr_schedule=opt.lr_scheduler(STEPS))
    seen = {}

    def grads(context):  # what the step differentiated
        leaves = named_leaves(context.grads, ".")
        seen["grads"] = [n for n, g in leaves if getattr(g, "array", g) is not None]
        return {}

    trainer.add_hook(_JitOnly(JitHook(grads)))
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    before = {
        n: np.asarray(x.array) for n, x in named_leaves(state.model, ".") if hasattr(x, "array")
    }
    opt_leaves = len(jax.tree.leaves(state.opt_state))
    tokens = np.random.default_rng(1).integers(0, VOCAB, 20 * MODEL.seq_len, dtype=np.int32)
    final = trainer.train(state, BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=3))
    after = {
        n: np.asarray(x.array)
        for n, x in named_leaves(final.state.model, ".")
        if hasattr(x, "array")
    }
    changed = {n for n in before if not np.array_equal(before[n], after[n])}
    return changed, set(before), seen["grads"], opt_leaves


class _JitOnly:
    """The smallest hook that adds a JitHook."""

    def __new__(cls, jit_hook):
        from loomax.train import Hook

        class Only(Hook):
            def jit_hooks(self):
                return [jit_hook]

        return Only()


@pytest.mark.parametrize("microbatches", [1, 2])
def test_frozen_parameters_stay_as_they_were(tmp_path, microbatches):
    changed, names, grads, opt_leaves = run(
        tmp_path / "frozen", ["embeddings", r"ln_final\."], microbatches
    )
    frozen = {n for n in names if "embeddings" in n or n.startswith("ln_final.")}
    assert frozen == {
        "token_embeddings.weight",
        "position_embeddings.weight",
        "ln_final.weight",
        "ln_final.bias",
    }
    assert changed == names - frozen  # everything else trained
    assert not frozen & set(grads)  # no gradient was computed for them
    changed_all, _, grads_all, opt_leaves_all = run(tmp_path / "all", [])
    assert changed_all == names and set(grads_all) == names
    assert opt_leaves < opt_leaves_all  # no Adam moments for the frozen ones


def test_mask_is_inexact_arrays_when_nothing_is_frozen():
    assert trainable_mask(object(), []) is eqx.is_inexact_array


def test_bad_freeze_regex_names_the_key():
    with pytest.raises(ValueError, match=r"trainer.freeze: bad regex '\('"):
        TrainerConfig(freeze=["("])


def test_frozen_parameters_left_out_of_checkpoints_come_back_on_resume(tmp_path):
    """``checkpoint_frozen: false``: the checkpoint lacks the frozen arrays; a resume takes
    them from where the run began (its seed's init) and continues bitwise as if never stopped."""
    from loomax.checkpoint import CheckpointerConfig, KeepPolicy, list_checkpoints

    def trainer(run_dir, steps):
        config = TrainerConfig(
            num_train_steps=steps,
            train_batch_size=BATCH,
            run_dir=str(run_dir),
            run_id="f",
            tracker=NoopTrackerConfig(),
            progress_bar=False,
            freeze=["token_embeddings"],
            checkpoint_frozen=False,
            checkpointer=CheckpointerConfig(keep=[KeepPolicy(every=2)]),
        )
        opt = AdamConfig(learning_rate=1e-2, warmup=0, lr_schedule="constant")
        return Trainer(config, opt.build(4), lm_loss(), lr_schedule=opt.lr_scheduler(4))

    def train(t):
        state = t.initial_state(lambda key: MODEL.build(VOCAB, key=key))
        tokens = np.random.default_rng(1).integers(0, VOCAB, 20 * MODEL.seq_len, dtype=np.int32)
        loader = BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=3)
        return t.train(state, loader.iter_from(int(state.step))).state

    straight = train(trainer(tmp_path / "straight", 4))
    train(trainer(tmp_path / "resumed", 2))
    (saved,) = list_checkpoints(str(tmp_path / "resumed" / "checkpoints"))
    assert saved.metadata["frozen_left_out"] == ["model/token_embeddings/weight"]
    assert "model/token_embeddings/weight" not in saved.metadata["arrays"]
    assert "model/position_embeddings/weight" in saved.metadata["arrays"]
    resumed = trainer(tmp_path / "resumed", 4)
    final = train(resumed)
    assert resumed.restored_from.step == 2
    for a, b in zip(jax.tree.leaves(straight.model), jax.tree.leaves(final.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
