"""LaunchConfig: every option documented in code and on the launching page; bad values named."""

from __future__ import annotations

import dataclasses

import pytest

from loomax.config_reference import undocumented
from loomax.errors import UserError
from loomax.launch import LaunchConfig


def test_every_option_has_a_doc_and_is_on_the_launching_page(repo_root):
    assert undocumented(LaunchConfig) == []
    page = (repo_root / "docs" / "launching.md").read_text()
    missing = [f.name for f in dataclasses.fields(LaunchConfig) if f"`{f.name}`" not in page]
    assert missing == []


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"num_processes": 0}, "launch.num_processes must be > 0, got 0"),
        ({"retries": -1}, "launch.retries must be >= 0, got -1"),
        ({"docker_build": True}, "launch.docker_build needs launch.docker_image"),
        ({"ssh_port": 0}, "launch.ssh_port must be in 1..65535, got 0"),
        ({"gpus_per_node": -1}, "launch.gpus_per_node must be >= 0, got -1"),
        ({"target": "gpu"}, "needs launch.hosts or launch.hostfile"),
        ({"hosts": ["a"], "hostfile": "h"}, "launch.hosts and launch.hostfile both name the hosts"),
        (
            {"runtime_version": "v"},
            "launch.accelerator_type and launch.runtime_version go together",
        ),
    ],
)
def test_bad_values_name_the_option(settings, message):
    with pytest.raises(UserError, match=message) as error:
        LaunchConfig(**settings)
    assert isinstance(error.value, ValueError)  # older callers catch ValueError
