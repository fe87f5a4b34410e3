"""Worker for the optimizer contract test: train a tiny GPT-2 with every optimizer, save, reload.

Run in-process (one device, with the reload) or as a subprocess with 8 fake CPU devices:
  python optimizer_run.py DATA     # mesh data=DATA (FSDP), no reload; prints one JSON line
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.config_reference import registry_members  # noqa: E402
from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import Gpt2Config  # noqa: E402
from loomax.optim import (  # noqa: E402
    AdafactorConfig,
    AdamConfig,
    ClipUpdateNormConfig,
    LionConfig,
    MuonConfig,
    OptimizerConfig,
    SkipBadStepsConfig,
)
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402

MODEL = Gpt2Config(
    seq_len=16,
    hidden_dim=32,
    num_layers=2,
    num_heads=4,
    gradient_checkpointing=False,
    cross_entropy_block_size=None,
)
VOCAB, STEPS, BATCH = 64, 6, 8
SCHEDULE = dict(warmup=0, lr_schedule="constant")
SETTINGS = {
    # adam with every optional transform of the shared chain switched on
    "adam": AdamConfig(
        learning_rate=3e-3,
        nesterov=True,
        update_rms_clipping=1.0,
        clip_update_norm=ClipUpdateNormConfig(rolling_interval_length=2, sigma_factor=2.0),
        skip_bad_steps=SkipBadStepsConfig(rolling_interval_length=4, sigma_factor=6.0),
        adamc_weight_decay=True,
        weight_decay_modules=["attn", "mlp"],
        warmup=2,
        lr_schedule="cosine",
    ),
    "lion": LionConfig(learning_rate=3e-4, **SCHEDULE),
    "adafactor": AdafactorConfig(learning_rate=1e-2, min_dim_size_to_factor=16, **SCHEDULE),
    "muon": MuonConfig(learning_rate=3e-3, **SCHEDULE),
}
"""Settings under which each optimizer learns the pattern in a few steps; a type not listed
runs with learning rate 3e-3 and its other defaults."""
OPTIMIZERS = {
    name: SETTINGS.get(name) or cls(learning_rate=3e-3, **SCHEDULE)
    for name, cls in registry_members(OptimizerConfig)
}
"""Every built-in ``optimizer.type`` (the registry's): a new optimizer file is in the contract."""


def batches():
    # a repeating pattern: easy to learn, so a few steps lower the loss
    tokens = np.tile(np.arange(VOCAB, dtype=np.int32), 12)
    return BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=0).iter_from(0)


def digest(tree) -> dict[str, str]:
    """Every array leaf's bytes, hex-hashed: equal digests mean bitwise-equal trees."""
    import hashlib

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            data = np.asarray(jax.device_get(leaf))
            out[jax.tree_util.keystr(path)] = hashlib.sha1(data.tobytes()).hexdigest()
    return out


def trainer_for(name: str, data: int, run_dir: str, **settings) -> Trainer:
    config = TrainerConfig(
        num_train_steps=STEPS,
        train_batch_size=BATCH,
        mesh=MeshConfig(1, data, 1),
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=run_dir,
        **settings,
    )
    optimizer = OPTIMIZERS[name]
    return Trainer(
        config,
        optimizer.build(STEPS),
        lm_loss(),
        lr_schedule=optimizer.lr_scheduler(STEPS),
        devices=jax.devices()[:data],
    )


WEIGHTS: list = []
"""The first run's fresh model, on the host: every optimizer starts from these weights."""


def fresh_state(trainer: Trainer):
    """The fresh state of ``trainer``: the first run's from the random init (compiled once per
    process), the others' from its weights through ``initial_weights`` (the product's start
    from given weights: the optimizer state made anew, no init compiled per optimizer)."""
    build = lambda key: MODEL.build(VOCAB, key=key)  # noqa: E731
    if WEIGHTS:
        return trainer.initial_state(build, initial_weights=lambda: WEIGHTS[0])
    state = trainer.initial_state(build)
    WEIGHTS.append(jax.device_get(state.model))  # before training donates it
    return state


def run(name: str, data: int = 1, restore: bool = True) -> dict:
    """Train ``STEPS`` steps with optimizer ``name`` (final checkpoint saved), then reload it."""
    run_dir = tempfile.mkdtemp()
    trainer = trainer_for(name, data, run_dir, load_checkpoint=False)
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    state = fresh_state(trainer)
    final = trainer.train(state, batches())
    trainer.finish()
    spec = str(jax.tree.leaves(final.state.model.blocks.stacked.mlp.up.weight)[0].sharding.spec)
    out = {
        "losses": losses,
        # on the host: jnp's isfinite and all would compile a program per leaf shape (~20)
        "finite": all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(final.state.model)),
        "mlp_up_spec": spec,
    }
    if restore:
        before = digest(final.state)
        again = trainer_for(name, data, run_dir, load_checkpoint=True)
        restored = again.initial_state(lambda key: MODEL.build(VOCAB, key=key))
        out["restored_equal"] = digest(restored) == before
        out["restored_step"] = int(restored.step)
    return out


if __name__ == "__main__":
    data = int(sys.argv[1])
    print(json.dumps({name: run(name, data, restore=False) for name in OPTIMIZERS}))
