"""The infra files the launcher names exist and agree with it."""

from __future__ import annotations

import yaml

from loomax.launch.docker import DOCKERFILE, build_and_push


def test_dockerfile_builds_the_variants_the_launcher_asks_for(repo_root):
    text = (repo_root / DOCKERFILE).read_text()
    assert "ARG ACCELERATOR=" in text
    for accelerator in ("gpu", "tpu"):
        build = build_and_push("img", accelerator)[0]
        assert f"ACCELERATOR={accelerator}" in build
        assert f"{accelerator})" in text  # a case of the install step
    assert 'CMD ["loomax", "train"' in text


def test_ray_cluster_yaml_starts_a_head_with_a_client_port(repo_root):
    cluster = yaml.safe_load((repo_root / "infra" / "ray" / "cluster.yaml").read_text())
    assert cluster["head_node_type"] in cluster["available_node_types"]
    assert any("--ray-client-server-port=10001" in c for c in cluster["head_start_ray_commands"])


def test_dockerignore_keeps_venvs_caches_runs_and_git_out_of_the_build(repo_root):
    lines = (repo_root / ".dockerignore").read_text().splitlines()
    patterns = {line.strip().rstrip("/") for line in lines if line.strip() and line[0] != "#"}
    for kept_out in (".venv", "cache", "runs", ".git", ".cache", "**/__pycache__", ".pytest_cache"):
        assert kept_out in patterns, kept_out
    assert "src" not in patterns and "config" not in patterns  # the image needs these


def test_single_node_slurm_script_is_idempotent_bash(repo_root):
    script = repo_root / "infra" / "slurm" / "single_node.sh"
    text = script.read_text()
    assert text.startswith("#!/bin/bash") and script.stat().st_mode & 0o111
    for step in ("apt-get install", "munged", "slurmctld", "slurmd", "JobCompType=jobcomp/filetxt"):
        assert step in text, step
    assert "pgrep -x slurmctld" in text  # started only when not running
