"""Default XLA flags: added once, never overriding the user's, and switchable off; and the
CPU kernel libraries a compiled program calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from loomax import _xla_flags
from loomax._xla_flags import append_xla_flags, apply_default_xla_flags

FLAG = {"--xla_cpu_experimental_ynn_fusion_type": "dot"}


def test_none_by_default_and_flags_appended_once(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.delenv("LOOMAX_XLA_DEFAULTS", raising=False)
    apply_default_xla_flags()  # nothing measured faster than XLA's own CPU defaults
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    monkeypatch.setattr(_xla_flags, "DEFAULT_XLA_FLAGS", FLAG)
    apply_default_xla_flags()
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8",
        "--xla_cpu_experimental_ynn_fusion_type=dot",
    ]


def test_user_setting_wins_and_opt_out(monkeypatch):
    monkeypatch.setattr(_xla_flags, "DEFAULT_XLA_FLAGS", FLAG)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type="
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("LOOMAX_XLA_DEFAULTS", "0")
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == ""
    monkeypatch.delenv("LOOMAX_XLA_DEFAULTS")
    append_xla_flags({"--a": "1"})
    assert os.environ["XLA_FLAGS"] == "--a=1"


def test_library_calls_and_fingerprint_read_compiled_hlo():
    from loomax._xla_flags import hlo_fingerprint, library_calls

    hlo = (
        'HloModule jit_a\n  %f = f32[2] fusion(%x), kind=kCustom, metadata={op_name="a"}, '
        'backend_config={"fusion_config":{"kind":"__ynn_fusion"}}\n'
        '  %g = f32[2] custom-call(%x), custom_call_target="__onednn$matmul"\n'
    )
    assert library_calls(hlo) == {"onednn": 1, "xnn": 0, "ynn": 1}
    renamed = hlo.replace("jit_a", "jit_b").replace('op_name="a"', 'op_name="b"')
    assert hlo_fingerprint(renamed) == hlo_fingerprint(hlo)  # names and metadata aside
    assert hlo_fingerprint(hlo.replace("f32[2]", "f32[3]")) != hlo_fingerprint(hlo)


def test_the_default_flags_take_effect_in_a_compiled_matmul():
    """With the defaults, XLA hands a matmul to YNNPACK (the library measured fastest); with
    YNN fusions turned off it does not: the count reads the flags' effect off the HLO."""
    code = (
        "import jax, jax.numpy as jnp, json\n"
        "from loomax._xla_flags import library_calls\n"
        "a = jnp.ones((256, 256))\n"
        "print(json.dumps(library_calls(jax.jit(lambda a: a @ a).lower(a).compile().as_text())))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    env.pop("LOOMAX_XLA_DEFAULTS", None)
    calls = []
    for flags in (None, "--xla_cpu_experimental_ynn_fusion_type="):
        if flags is not None:
            env["XLA_FLAGS"] = flags
        out = subprocess.run(
            [sys.executable, "-c", "import loomax\n" + code],
            env=env,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        calls.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert calls[0] == {"onednn": 0, "xnn": 0, "ynn": 1}
    assert calls[1] == {"onednn": 0, "xnn": 0, "ynn": 0}
