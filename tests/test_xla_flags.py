"""Default XLA flags: added once, never overriding the user's, and switchable off."""

from __future__ import annotations

from loomax._xla_flags import apply_default_xla_flags


def test_adds_onednn_when_unset(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.delenv("LOOMAX_XLA_DEFAULTS", raising=False)
    apply_default_xla_flags()
    apply_default_xla_flags()
    import os

    flags = os.environ["XLA_FLAGS"].split()
    assert flags == ["--xla_force_host_platform_device_count=8", "--xla_cpu_use_onednn=true"]


def test_user_setting_wins_and_opt_out(monkeypatch):
    import os

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_onednn=false")
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_use_onednn=false"
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("LOOMAX_XLA_DEFAULTS", "0")
    apply_default_xla_flags()
    assert os.environ["XLA_FLAGS"] == ""
