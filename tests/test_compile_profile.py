"""bench/compile_profile_site logs each JAX compile of a process it is on the path of."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_process_logs_its_trace_lowering_and_compile_and_the_summary_reads_them(tmp_path):
    out = tmp_path / "log.jsonl"
    site = [REPO / "bench" / "compile_profile_site", REPO / "tests" / "support" / "gc_site"]
    env = {
        **os.environ,
        "COMPILE_PROFILE_OUT": str(out),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(map(str, [*site, os.environ.get("PYTHONPATH", "")])),
    }
    code = "import gc, jax, jax.numpy as jnp; jax.jit(lambda x: x * 3)(jnp.ones(4)); print(gc.get_threshold())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[0] == "(50000,"  # the suite's GC settings still load
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = {(kind, name) for kind, name, *_ in row["rec"]}
    assert {("T", "<lambda>"), ("L", "jit(<lambda>)"), ("C", "jit(<lambda>)")} <= kinds
    assert 0 < row["first_compile_cpu"] <= row["cpu"]
    sys.path.insert(0, str(REPO / "bench"))
    from compile_profile import summarise

    text = summarise(str(out))
    assert "1 processes" in text and "jit(<lambda>)" in text
