"""LoRA under FSDP x tensor parallelism (4 fake CPU devices, data 2 x model 2): the trainer
trains the adapters alone (the base bit for bit unchanged, the optimizer state holding only
adapter moments) and the adapters are sharded by the weights' own axis mappings; the final
checkpoint reads back (loomax.inference) with the trained logits, merged or not; a QLoRA
(nf4) base's codes and scales are split as the weight is, and stay unchanged."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("lora_sharded_run.py")


@pytest.mark.slow
def test_adapters_train_alone_sharded_like_their_weights(json_worker):
    out = json_worker(WORKER, devices=4)
    assert len(out["losses"]) == 5 and all(math.isfinite(x) for x in out["losses"])
    assert out["base_unchanged"]
    # the final checkpoint read back as loomax export/generate do: adapters merged or kept
    assert max(out["read_back"].values()) < 1e-5, out["read_back"]
    assert out["lora_b_max"] > 0  # B left zero: the adapters trained
    # A's input axis (embed) is FSDP-split over data; B's heads over model (tensor parallel)
    assert out["specs"]["lora_a"] == [["layers", "lora_r", "embed"], "P(None, None, 'data')"]
    assert out["specs"]["lora_b"] == [
        ["layers", "heads", "head_size", "lora_r"],
        "P(None, 'model', None, None)",
    ]
    leaves = out["opt_leaves"]
    assert len(leaves) == 2 * 14  # Adam's mu and nu of 7 layers' A and B, nothing else
    assert all(n.endswith((".lora_a", ".lora_b")) for n in leaves)
    # QLoRA (nf4): the codes and scales split by the weight's own axis mappings (FSDP over
    # data by embed, tensor parallel over model by heads), unchanged by training
    qlora = out["qlora"]
    assert len(qlora["losses"]) == 5 and all(math.isfinite(x) for x in qlora["losses"])
    assert qlora["codes_unchanged"]
    assert qlora["specs"]["codes"] == [
        ["layers", "heads", "head_size", "embed"],
        "P(None, 'model', None, 'data')",
    ]
    assert qlora["specs"]["scales"][0] == ["layers", "heads", "head_size", "embed"]
