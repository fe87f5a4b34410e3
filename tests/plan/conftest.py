"""Fixtures of the compile-only plan tests."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import pytest


@pytest.fixture(scope="module")
def quick_compiles() -> Iterator[None]:
    """The module's compiles at XLA's lowest execution-time optimization effort.

    libtpu then leaves out optimizations that only make the program run faster and compiles in
    about half the CPU time (DeepSeek-V3's shrunk step 52.6 against 29.9 CPU-s; llama_1b's
    10.4 against 7.3; AMD EPYC). For files whose checks (a config builds, partitions,
    compiles and fits; its state bytes; which kernels it calls) do not depend on those
    optimizations, nor on the estimate beyond its order (best <= expected <= worst). Not for
    tests that bound the estimate's value or the memory: the estimate and the
    temporaries change (llama_1b's temporaries 19.2 against 23.6 MB). ``loomax compile``
    keeps the default effort.

    libtpu's own options save nothing more (LIBTPU_INIT_ARGS, DeepSeek-V3's shrunk step at
    this effort, backend compile alone, AMD EPYC, loaded: 28.99 CPU-s as is; the latency-hiding
    scheduler off 28.11; the HLO, LLO and register-allocation verifiers and the LLO type and
    bounds checks off 28.23): libtpu's compile of these steps is the floor. On GPUs
    (the CUDA plugin, compile-only) this effort changes nothing (tiny Llama on h100:8:
    4.41-4.75 against 4.28-4.47 CPU-s, the same program); ``--xla_gpu_enable_triton_gemm=false``
    would save a quarter (3.15-3.42) but compiles a different program (cuBLAS, 2.3 against
    35.6 MB of temporaries) from the one ``loomax compile`` plans, so it is not used.
    """
    before = jax.config.jax_exec_time_optimization_effort
    jax.config.update("jax_exec_time_optimization_effort", -1.0)
    yield
    jax.config.update("jax_exec_time_optimization_effort", before)
