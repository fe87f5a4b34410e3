"""HF export hook: at the end of a real run, in a chosen dtype, validated by reading it back."""

from __future__ import annotations

import json

import jax
import pytest
from safetensors.numpy import load_file, save_file

from loomax.hooks import HfExportHook
from loomax.hooks.hf_export import ExportMismatchError, _check_reload


def test_exported_at_the_end_in_bfloat16_and_checked_by_reading_it_back(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=2)
    at_end = HfExportHook(every=1000, dtype="bfloat16", run_dir=trainer.run_dir)
    never = HfExportHook(every=1000, at_end=False, path=str(tmp_path / "never"))
    trainer.add_hook(at_end)
    trainer.add_hook(never)
    final = trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    (out,) = at_end.written
    assert out == trainer.run_dir / "hf" / "step-2" and not never.written
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = load_file(out / "model.safetensors")
    assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}

    # a file that does not hold what was written fails the check
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cast = jax.tree.map(
        lambda x: x.astype("bfloat16") if x.dtype.kind == "f" else x, final.state.model
    )
    with pytest.raises(ExportMismatchError, match="a weight read back differs"):
        _check_reload(cast, out)
    with pytest.raises(ValueError, match=r"\(hf_export\): dtype must be one of"):
        HfExportHook(dtype="int8", path="x")
