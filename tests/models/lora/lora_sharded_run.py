"""Worker for the LoRA sharding test: a tiny Llama with adapters trained 5 steps on 4 fake
CPU devices, mesh data 2 (FSDP) x model 2 (tensor parallel), the base frozen through
model.lora's trainer.freeze patterns; prints JSON (losses, whether the base changed, the
adapters' shardings, the optimizer state's arrays).

  python lora_sharded_run.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2] / "train"))
from sharded_run import VOCAB, loader, make_trainer  # noqa: E402

from loomax.checkpoint import CheckpointerConfig, list_checkpoints  # noqa: E402
from loomax.inference import _read_model  # noqa: E402
from loomax.lm import TrainLmConfig  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.models.lora.config import LoraConfig  # noqa: E402
from loomax.models.lora.linear import without_adapters  # noqa: E402
from loomax.tree_paths import named_leaves  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8.0)
MODEL = LlamaConfig(
    seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
    lora=LORA,
)  # fmt: skip


def main() -> dict:
    run_dir = tempfile.mkdtemp()
    trainer = make_trainer(
        MeshConfig(data=2, model=2), run_dir, freeze=LORA.freeze_patterns(),
        checkpointer=CheckpointerConfig(save_at_end=True),  # read back below
    )  # fmt: skip
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    state = trainer.initial_state(lambda key: MODEL.for_training(MODEL.build(VOCAB, key=key)))
    base = jax.device_get(eqx.filter(without_adapters(state.model), eqx.is_inexact_array))
    q = state.model.blocks.stacked.attn.q_proj
    specs = {
        "lora_a": [[a.name for a in q.lora_a.axes], str(q.lora_a.array.sharding.spec)],
        "lora_b": [[a.name for a in q.lora_b.axes], str(q.lora_b.array.sharding.spec)],
    }
    opt_leaves = sorted(
        n for n, x in named_leaves(state.opt_state, ".") if getattr(x, "ndim", 0) > 0
    )
    final = trainer.train(state, loader().iter_from(0, 0, 1)).state
    after = jax.device_get(eqx.filter(without_adapters(final.model), eqx.is_inexact_array))
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), base, after)
    b_moved = float(np.abs(np.asarray(final.model.blocks.stacked.attn.q_proj.lora_b.array)).max())
    # the trainer's final checkpoint read back as loomax export/generate read it
    checkpoint = list_checkpoints(str(Path(run_dir) / "checkpoints"))[-1]
    ids = hax.named(np.arange(16) % VOCAB, "position")
    want = np.asarray(final.model.logits(ids).array)
    config = TrainLmConfig(model=MODEL)
    read = {
        name: float(np.abs(np.asarray(_read_model(checkpoint, config, VOCAB, merge=merge)
                                      .logits(ids).array) - want).max())
        for name, merge in (("merged", True), ("unmerged", False))
    }  # fmt: skip
    return {
        "read_back": read,
        "losses": losses,
        "base_unchanged": all(jax.tree.leaves(same)),
        "lora_b_max": b_moved,
        "specs": specs,
        "opt_leaves": opt_leaves,
        "qlora": qlora(),
    }


def qlora() -> dict:
    """The same with an nf4 base (model.lora.quantize_base): losses, the codes' and scales'
    shardings, whether the codes changed."""
    lora = LoraConfig(rank=4, alpha=8.0, quantize_base="nf4")
    model = dataclasses.replace(MODEL, lora=lora)
    trainer = make_trainer(
        MeshConfig(data=2, model=2), tempfile.mkdtemp(), freeze=lora.freeze_patterns()
    )
    losses: list[float] = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    state = trainer.initial_state(lambda key: model.for_training(model.build(VOCAB, key=key)))
    stored = state.model.blocks.stacked.attn.q_proj.quantized
    specs = {
        name: [[a.name for a in x.axes], str(x.array.sharding.spec)]
        for name, x in (("codes", stored.codes), ("scales", stored.scales))
    }
    codes = np.asarray(stored.codes.array)
    final = trainer.train(state, loader().iter_from(0, 0, 1)).state
    after = np.asarray(final.model.blocks.stacked.attn.q_proj.quantized.codes.array)
    return {"losses": losses, "specs": specs, "codes_unchanged": bool(np.array_equal(codes, after))}


if __name__ == "__main__":
    print(json.dumps(main()))
