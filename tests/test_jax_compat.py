"""The JAX compatibility shims: haliax keeps working on JAX releases that dropped names it uses."""

from __future__ import annotations

import types

import jax
import pytest

from loomax import _jax_compat


def test_nothing_changes_before_jax_0_11(monkeypatch):
    monkeypatch.setattr(_jax_compat, "installed_version", lambda package: (0, 10, 2))
    assert _jax_compat.apply_jax_compat() == []


def test_removed_names_come_back_from_jax_internals(monkeypatch):
    """JAX 0.11 took ``jax.core.is_constant_dim`` away; haliax's einsum calls it."""
    bare = types.ModuleType("jax.core")  # jax.core as 0.11 has it: without the name
    monkeypatch.setattr(jax, "core", bare)
    monkeypatch.setattr(_jax_compat, "installed_version", lambda package: (0, 11, 2))
    assert _jax_compat.apply_jax_compat() == ["jax.core.is_constant_dim"]
    assert bare.is_constant_dim(3) and not bare.is_constant_dim("n")
    assert _jax_compat.apply_jax_compat() == []  # once is enough


def test_named_einsum_works_after_loomax_is_imported():
    import haliax as hax
    import jax.numpy as jnp

    import loomax  # noqa: F401 - applies the shims

    a = hax.ones((hax.Axis("x", 3), hax.Axis("y", 4)))
    b = hax.ones((hax.Axis("y", 4), hax.Axis("z", 2)))
    assert jnp.all(hax.dot(a, b, axis="y").array == 4)


@pytest.mark.parametrize(("text", "want"), [("0.11.2", (0, 11, 2)), ("1.4.dev453", (1, 4, 453))])
def test_installed_version(monkeypatch, text, want):
    monkeypatch.setattr(_jax_compat, "version", lambda package: text)
    assert _jax_compat.installed_version("jax") == want
