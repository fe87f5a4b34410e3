"""Worker for the sharded QK-clip test: a tiny Llama trained 3 steps with optimizer.qk_clip_tau
on one device and on data 4 x model 2 (FSDP and tensor parallel: q/k projections split by
heads and by embed) of 8 fake CPU devices; prints JSON.

  python qk_clip_run.py
"""

from __future__ import annotations

import json
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.models.attention import max_logits  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig  # noqa: E402

MODEL = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=32, num_layers=2, num_heads=4,
                    num_kv_heads=4, attn_backend="vanilla")  # fmt: skip
VOCAB, STEPS, BATCH = 64, 3, 8


def tau() -> float:
    """The median of the initial model's per-head maxima on the first batch: some heads clip."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, (BATCH, MODEL.seq_len), dtype=np.int32)

    @jax.jit  # one program, not the build and forward op by op
    def first_stack_maxima(key):
        with max_logits.collecting() as seen:
            lm_loss()(MODEL.build(VOCAB, key=key), tokens, key=None)
        return seen[max_logits.stack_key(0)].array

    return float(np.median(np.asarray(first_stack_maxima(jax.random.PRNGKey(0)))))


def run(mesh: MeshConfig, devices, threshold: float) -> dict:
    config = TrainerConfig(num_train_steps=STEPS, train_batch_size=BATCH, mesh=mesh,
                           progress_bar=False, tracker=NoopTrackerConfig(), run_dir=tempfile.mkdtemp())  # fmt: skip
    opt = AdamConfig(learning_rate=3e-3, warmup=0)
    trainer = Trainer(config, opt.build(STEPS), lm_loss(), devices=devices, qk_clip_tau=threshold)
    seen: list[list[float]] = []
    keys = ("train/loss", "optim/max_logit", "optim/qk_clipped_heads")
    trainer.add_hook(lambda info: seen.append([float(info.metrics[k]) for k in keys]))
    state = trainer.initial_state(lambda key: MODEL.build(VOCAB, key=key))
    q = state.model.blocks.stacked.attn.q_proj.weight
    tokens = np.random.default_rng(0).integers(0, VOCAB, 40 * MODEL.seq_len, dtype=np.int32)
    batches = BatchLoader(TokenWindows(tokens, MODEL.seq_len), BATCH, seed=0)
    final = trainer.train(state, batches.iter_from(0, 0, 1))
    weight = final.state.model.blocks.stacked.attn.q_proj.weight.array
    return {
        "metrics": seen,
        "q_spec": str(q.array.sharding.spec),
        "q_axes": [a.name for a in q.axes],
        "q_final": np.asarray(jax.device_get(weight)).ravel().tolist(),
    }


def main() -> None:
    threshold = tau()
    one = run(MeshConfig(data=1), jax.devices()[:1], threshold)
    split = run(MeshConfig(data=4, model=2), jax.devices(), threshold)
    print(json.dumps({"tau": threshold, "one": one, "split": split}))


if __name__ == "__main__":
    main()
