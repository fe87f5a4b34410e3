"""The packages of the `test` extra fail the tests that need them when missing, never skip them."""

from __future__ import annotations

import pytest


def test_a_missing_module_of_the_test_extra_fails_naming_the_install(require_extra):
    with pytest.raises(pytest.fail.Exception) as failed:
        require_extra("loomax_no_such_module", "this check")
    assert str(failed.value) == (
        "this check needs the Python module loomax_no_such_module, which the test extra "
        "installs: pip install -e '.[test]'"
    )
    require_extra("pytest", "this check")  # present: nothing happens


@pytest.mark.parametrize(
    "fixture", ["needs_lm_eval", "needs_transformers", "needs_peft", "needs_hf_backend", "libtpu"]
)
def test_the_test_extra_is_installed(request, fixture):
    request.getfixturevalue(fixture)  # fails (not skips) where the package is missing
