"""``loomax launch --dry-run``: the exact commands for TPU pods, GPU hosts and SLURM."""

from __future__ import annotations

import pytest

from loomax.cli import main


@pytest.fixture(autouse=True)
def launch_env(monkeypatch, tmp_path):
    """A fixed commit, one secret and one plain variable to forward; cwd without .loomax.yaml."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOOMAX_GIT_COMMIT", "abc123")
    monkeypatch.setenv("WANDB_API_KEY", "s3cret-key")
    monkeypatch.setenv("WANDB_PROJECT", "ladder")
    for name in ("WANDB_ENTITY", "WANDB_MODE", "HF_TOKEN", "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TPU_STDERR_LOG_LEVEL", raising=False)
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def dry_run(capsys, *options: str, command=("train", "--config_path", "config/gpt2_small.yaml")):
    with pytest.raises(SystemExit) as exit:
        main(["launch", *options, "--run_id", "r1", "--dry-run", "--", *command])
    out = capsys.readouterr()
    assert exit.value.code == 0, out.err
    assert "s3cret-key" not in out.out  # secrets are masked in what is printed
    return out.out.splitlines()


ENV = "env WANDB_API_KEY=*** WANDB_PROJECT=ladder LOOMAX_GIT_COMMIT=abc123"


def stop_earlier(pidfile: str) -> str:
    """The prefix that stops what an earlier attempt left running, then records this one's pid."""
    return (
        f"{{ p=$(cat {pidfile} 2>/dev/null) && grep -qa loomax /proc/$p/cmdline 2>/dev/null "
        f"&& kill $p && sleep 5; }}; echo $$ > {pidfile} && exec"
    )


TRAIN = "train --config_path config/gpt2_small.yaml --trainer.run_id r1"


def test_tpu_pod(capsys):
    lines = dry_run(
        capsys, "--target", "tpu", "--tpu_name", "t1", "--zone", "us-central2-b", "--retries", "2"
    )
    assert lines == [
        "# loomax launch --target tpu, retries: 2",
        "gcloud compute tpus tpu-vm ssh t1 --zone us-central2-b --worker=all --command "
        f"'cd ~/loomax && {stop_earlier('/tmp/loomax-launch.pid')} {ENV} .venv/bin/loomax {TRAIN}'",
        "# on failure: all of the above again, up to 2 more time(s)",
    ]


def test_tpu_settings_come_from_loomax_yaml_and_docker(capsys, tmp_path):
    (tmp_path / ".loomax.yaml").write_text(
        "tpu_name: pod-v4\nzone: us-central2-b\nproject: my-proj\n"
        "docker_image: gcr.io/my-proj/loomax:dev\nenv: {TPU_MIN_LOG_LEVEL: '0'}\n"
    )
    lines = dry_run(capsys, "--target", "tpu", "--docker_build")
    assert lines[1:3] == [
        "docker build -t gcr.io/my-proj/loomax:dev -f infra/docker/Dockerfile --build-arg ACCELERATOR=tpu .",
        "docker push gcr.io/my-proj/loomax:dev",
    ]
    ssh = lines[3]
    assert ssh.startswith(
        "gcloud compute tpus tpu-vm ssh pod-v4 --zone us-central2-b --project my-proj --worker=all --command "
    )
    assert "docker rm -f loomax >/dev/null 2>&1; docker run --rm --name loomax --net=host" in ssh
    assert (
        "--privileged" in ssh and "-e WANDB_API_KEY=***" in ssh and "-e TPU_MIN_LOG_LEVEL=0" in ssh
    )
    assert f"gcr.io/my-proj/loomax:dev loomax {TRAIN}" in ssh


def test_gpu_hosts_one_process_per_gpu(capsys, tmp_path):
    (tmp_path / "hosts").write_text("# two nodes\nubuntu@gpu-a\ngpu-b  # second\n\n")
    lines = dry_run(capsys, "--target", "gpu", "--hostfile", "hosts", "--processes_per_host", "2")
    ssh = "ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new"
    expected = []
    for pid, (host, gpu) in enumerate(
        [("ubuntu@gpu-a", 0), ("ubuntu@gpu-a", 1), ("gpu-b", 0), ("gpu-b", 1)]
    ):
        dist = (
            f"LOOMAX_COORDINATOR_ADDRESS=gpu-a:8476 LOOMAX_NUM_PROCESSES=4 LOOMAX_PROCESS_ID={pid} "
            f"CUDA_VISIBLE_DEVICES={gpu}"
        )
        stop = stop_earlier(f"/tmp/loomax-launch-{pid}.pid")
        expected.append(
            f"{ssh} {host} 'cd ~/loomax && {stop} {ENV} {dist} .venv/bin/loomax {TRAIN}'"
        )
    assert lines[1:] == expected


def test_gpu_hosts_with_ports_and_a_key(capsys, tmp_path):
    (tmp_path / "key").write_text("a key")
    lines = dry_run(
        capsys, "--target", "gpu", "--hosts", "[127.0.0.1:2222, me@127.0.0.1]",
        "--ssh_port", "2200", "--ssh_identity", "key", "--coordinator_port", "9000",
        "--ssh_options", "[-o, StrictHostKeyChecking=no]",
    )  # fmt: skip
    assert len(lines) == 3
    for pid, prefix in enumerate(
        ["ssh -p 2222 -i key -o StrictHostKeyChecking=no 127.0.0.1 ",
         "ssh -p 2200 -i key -o StrictHostKeyChecking=no me@127.0.0.1 "]
    ):  # fmt: skip
        line = lines[1 + pid]
        assert line.startswith(prefix), line
        assert f"/tmp/loomax-launch-{pid}.pid" in line  # a host listed twice: a pidfile each
        assert (
            f"LOOMAX_COORDINATOR_ADDRESS=127.0.0.1:9000 LOOMAX_NUM_PROCESSES=2 LOOMAX_PROCESS_ID={pid}"
            in line
        )


def test_tpu_recreate_shows_create_and_run(capsys):
    lines = dry_run(
        capsys, "--target", "tpu", "--tpu_name", "t1", "--zone", "us-central2-b",
        "--accelerator_type", "v4-8", "--runtime_version", "tpu-ubuntu2204-base", "--spot",
        "--setup_command", "git clone https://example.org/loomax ~/loomax", "--retries", "1",
    )  # fmt: skip
    vm = "gcloud compute tpus tpu-vm {} t1 --zone us-central2-b"
    assert lines[1].startswith("# before each attempt")
    assert lines[2:6] == [
        vm.format("describe") + " '--format=value(state)'",
        vm.format("delete") + " --quiet",
        vm.format("create") + " --accelerator-type v4-8 --version tpu-ubuntu2204-base --spot",
        vm.format("ssh")
        + " --worker=all --command 'git clone https://example.org/loomax ~/loomax'",
    ]
    assert lines[6].startswith(vm.format("ssh") + " --worker=all --command 'cd ~/loomax && ")
    assert lines[7] == "# on failure: all of the above again, up to 1 more time(s)"


def test_slurm_script_and_sbatch(capsys):
    lines = dry_run(
        capsys, "--target", "slurm", "--nodes", "4", "--partition", "gpu", "--retries", "1"
    )
    assert lines[1] == "# .loomax/slurm/loomax-r1.sbatch:"
    script = "\n".join(lines[2:-1])
    for expected in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "cd ~/loomax",
        "export WANDB_API_KEY=***",
        "export LOOMAX_GIT_COMMIT=abc123",
        "for attempt in $(seq 0 1); do",
        f"srun --kill-on-bad-exit=1 .venv/bin/loomax {TRAIN}",
    ):
        assert expected in script, expected
    assert "@@" not in script
    assert lines[-1] == "sbatch .loomax/slurm/loomax-r1.sbatch"


def test_local_processes_get_coordinator_and_ids(capsys):
    lines = dry_run(capsys, "--target", "local", "--num_processes", "3")
    assert len(lines) == 4
    for pid, line in enumerate(lines[1:]):
        assert "LOOMAX_COORDINATOR_ADDRESS=127.0.0.1:" in line
        assert f"LOOMAX_NUM_PROCESSES=3 LOOMAX_PROCESS_ID={pid}" in line
        assert line.endswith(f"-m loomax.cli {TRAIN}")


def test_a_run_named_by_the_command_is_left_alone(capsys):
    lines = dry_run(
        capsys,
        "--target",
        "tpu",
        "--tpu_name",
        "t",
        "--zone",
        "z",
        command=("train", "--config_path", "c.yaml", "--trainer.run_id", "mine"),
    )
    assert lines[1].endswith("train --config_path c.yaml --trainer.run_id mine'")


@pytest.mark.parametrize(
    "options, command, message",
    [
        (["--target", "tpu", "--zone", "z"], ["train"], "needs --tpu_name and --zone"),
        (["--target", "gpu"], ["train"], "needs launch.hosts or launch.hostfile"),
        (["--target", "moon"], ["train"], "launch.target must be one of local, tpu, gpu, slurm"),
        (["--target", "local"], [], "nothing to run after `--`"),
        (["--target", "local"], ["fly"], "'fly' is not a loomax command"),
        (
            ["--target", "gpu", "--hostfile", "nope"],
            ["train"],
            "launch.hostfile: no such file: nope",
        ),
        (["--target", "gpu", "--hosts", "[h:22x]"], ["train"], "launch.hosts: bad host 'h:22x'"),
        (
            ["--target", "gpu", "--hosts", "[h]", "--ssh_port", "70000"],
            ["train"],
            "launch.ssh_port must be in 1..65535, got 70000",
        ),
        (
            ["--target", "gpu", "--hosts", "[h]", "--ssh_identity", "no-key"],
            ["train"],
            "launch.ssh_identity: no such key file: no-key",
        ),
        (
            ["--target", "tpu", "--tpu_name", "t", "--zone", "z", "--accelerator_type", "v4-8"],
            ["train"],
            "launch.accelerator_type and launch.runtime_version go together",
        ),
    ],
)
def test_bad_options_name_what_is_wrong(capsys, options, command, message):
    with pytest.raises(SystemExit) as exit:
        main(["launch", *options, "--dry-run", "--", *command])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("target, tool", [("slurm", "sbatch"), ("gpu", "ssh"), ("tpu", "gcloud")])
def test_a_missing_tool_is_named_before_anything_starts(
    capsys, monkeypatch, tmp_path, target, tool
):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    options = {"gpu": ["--hosts", "[h1]"], "tpu": ["--tpu_name", "t", "--zone", "z"]}
    with pytest.raises(SystemExit) as exit:
        main(["launch", "--target", target, *options.get(target, []), "--", "train"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"launch.target {target} needs `{tool}` on PATH: not found" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / ".loomax").exists()  # nothing written, nothing started


def test_missing_separator():
    with pytest.raises(SystemExit) as exit:
        main(["launch", "--target", "local", "train"])
    assert exit.value.code == 2


def test_infra_launch_py_is_the_same_command(repo_root, tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(repo_root / "infra" / "launch.py"), "--target", "tpu",
         "--tpu_name", "t1", "--zone", "us-central2-b", "--run_id", "r1", "--dry-run", "--", "train"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "gcloud compute tpus tpu-vm ssh t1 --zone us-central2-b --worker=all" in out.stdout
