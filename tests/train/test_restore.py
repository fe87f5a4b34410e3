"""A fresh state's init program (``loomax.train.restore.init_program``) on XLA:CPU.

The init compiles with ``CPU_INIT_COMPILER_OPTIONS`` (a cheaper LLVM pipeline, XLA's
elemental fusion emitters); its values must be bitwise those of XLA:CPU's default
compile, for every registered model family, or a run's start would depend on the options.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from loomax._jax_compat import installed_version
from loomax.config_reference import registry_members
from loomax.models import LmConfig
from loomax.train import restore

MODEL_TYPES = [name for name, _ in registry_members(LmConfig)]
"""Every built-in model type."""
DEFAULT_CPU_OPTIONS = {"xla_backend_optimization_level": 3}
"""XLA:CPU's defaults for what ``CPU_INIT_COMPILER_OPTIONS`` changes (the tests' own XLA flags
set other values, so the reference names them)."""
if installed_version("jaxlib") < (0, 11):
    DEFAULT_CPU_OPTIONS["xla_cpu_use_fusion_emitters"] = True


def _fresh_leaves(tiny, tmp_path, config, monkeypatch, options):
    monkeypatch.setattr(restore, "CPU_INIT_COMPILER_OPTIONS", options)
    trainer = tiny.trainer(tmp_path / str(len(list(tmp_path.iterdir()))), steps=1)
    state = trainer.initial_state(lambda key: config.build(tiny.vocab, key=key))
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_cpu_init_options_give_the_default_compiles_values_bitwise(
    model_type, families, tiny, tmp_path, monkeypatch
):
    config = families.tiny_config(model_type)
    cheap = _fresh_leaves(tiny, tmp_path, config, monkeypatch, restore.CPU_INIT_COMPILER_OPTIONS)
    default = _fresh_leaves(tiny, tmp_path, config, monkeypatch, DEFAULT_CPU_OPTIONS)
    assert len(cheap) == len(default) > 10
    for a, b in zip(cheap, default, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(a.dtype == np.float32 and a.std() > 0 for a in cheap)  # random values compared


def test_the_init_compiles_with_the_cpu_options(tiny, tmp_path, monkeypatch):
    """An option XLA does not know fails the compile: the options reach it."""
    monkeypatch.setattr(restore, "CPU_INIT_COMPILER_OPTIONS", {"xla_no_such_option": 1})
    trainer = tiny.trainer(tmp_path, steps=1)
    with pytest.raises(Exception, match="xla_no_such_option"):
        trainer.initial_state(lambda key: tiny.model.build(tiny.vocab, key=key))
