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
    """
    before = jax.config.jax_exec_time_optimization_effort
    jax.config.update("jax_exec_time_optimization_effort", -1.0)
    yield
    jax.config.update("jax_exec_time_optimization_effort", before)
