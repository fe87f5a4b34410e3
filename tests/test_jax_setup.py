"""trainer.jax_compilation_cache_dir and trainer.jax_config."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from loomax.train import TrainerConfig


def test_unknown_jax_option_names_the_key():
    with pytest.raises(
        ValueError, match="trainer.jax_config: unknown JAX option.*jax_no_such_flag"
    ):
        TrainerConfig(jax_config={"jax_no_such_flag": True})


def test_trainer_applies_the_cache_dir_and_options(tmp_path):
    script = f"""
import jax, jax.numpy as jnp, optax
from loomax.train import TrainerConfig, setup_process
config = TrainerConfig(
    run_dir={str(tmp_path / "run")!r},
    jax_compilation_cache_dir={str(tmp_path / "cache")!r},
    jax_config={{"jax_persistent_cache_min_compile_time_secs": 0, "jax_default_matmul_precision": "highest"}},
)
setup_process(config)
assert jax.config.jax_default_matmul_precision == "highest"
jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(4)).block_until_ready()
"""
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert any((tmp_path / "cache").iterdir())  # the compiled function landed in the cache


def test_jax_config_is_untouched_by_default():
    before = jax.config.jax_default_matmul_precision
    TrainerConfig()
    assert jax.config.jax_default_matmul_precision == before


def test_a_cpu_host_with_libtpu_starts_jax_without_tpu_noise():
    """libtpu is installed (the test extra) but this host has no TPU chip: importing loomax
    keeps JAX from starting its TPU backend, whose probes and "Unable to initialize backend
    'tpu'" a new user would otherwise see on every command."""
    from loomax.jax_setup import has_tpu_chips

    if has_tpu_chips():
        pytest.skip("this host has TPU chips")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "import loomax, jax\n"
        "print(jax.default_backend(), jax.config.jax_platforms)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["cpu", "cpu"]
    for noise in ("Unable to initialize backend", "TPU_", "libtpu", "jellyfish", "CUDA", "cuda"):
        assert noise not in done.stderr, done.stderr[-2000:]


def test_a_gpu_plugin_without_its_gpu_is_left_out(monkeypatch):
    """JAX's CUDA plugin (the test extra, for GPU topologies) on a host without an NVIDIA GPU:
    JAX starts on the CPU only; with the GPU present, CUDA stays in."""
    from loomax import jax_setup

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setitem(sys.modules, "jax", None)  # as if JAX were not imported yet
    monkeypatch.setattr(jax_setup, "has_tpu_chips", lambda: False)
    monkeypatch.setattr(jax_setup, "_gpu_platforms", lambda: ["cuda"])
    monkeypatch.setattr(jax_setup.importlib.util, "find_spec", lambda name: None)  # no libtpu
    monkeypatch.setattr(jax_setup, "has_gpus", lambda platform="cuda": False)
    assert jax_setup.choose_platforms() == "cpu"
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(jax_setup, "has_gpus", lambda platform="cuda": True)
    assert jax_setup.choose_platforms() is None  # every installed accelerator is present
    assert "JAX_PLATFORMS" not in os.environ
