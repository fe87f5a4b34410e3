"""Compile one configuration in a child process, so a compiler crash costs one candidate.

libtpu's (or XLA's GPU) compiler can abort the whole process on programs it cannot lower (a failed
CHECK, SIGABRT); ``compile_isolated`` runs ``python -m loomax.plan.worker`` and turns such
a crash into a reported error. The child prints its ``CompileResult`` as JSON, last.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence

from loomax.plan.compile import CompileResult

_MARK = "LOOMAX_COMPILE_RESULT "


class CompileCrash(RuntimeError):
    """The compile child died or failed; the message has the reason XLA or Python gave."""


def setup_compile_only(topology: str) -> None:
    """JAX settings for compiling for a named topology: CPU backend only (the TPU or GPU
    devices are compile-only) and no persistent compilation cache (it cannot hold their
    programs here)."""
    if topology == "local":
        return
    import jax

    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_enable_compilation_cache", False)


def compile_isolated(
    config_args: Sequence[str],
    topology: str,
    *,
    measure: int = 0,
    timeout: float | None = None,
    load_max: float | None = None,
) -> CompileResult:
    """``compile_run`` of the config ``config_args`` (``--config_path F --key value ...``) in a
    child process (an RL run's: ``plan.rl.compile_rl``, an ``RlCompileResult``); raises
    ``CompileCrash`` with the child's last error line if it fails."""
    load = "" if load_max is None else repr(float(load_max))
    command = [
        sys.executable, "-m", "loomax.plan.worker", topology, str(measure), load, *config_args
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise CompileCrash(f"compile took longer than {timeout:.0f} s") from e
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_MARK):
            found = json.loads(line[len(_MARK) :])
            if set(found) == {"rollout", "update"}:  # an RL run's two programs (plan/rl.py)
                from loomax.plan.rl import RlCompileResult

                return RlCompileResult(*(CompileResult(**found[k]) for k in ("rollout", "update")))
            return CompileResult(**found)
    raise CompileCrash(_reason(done.returncode, done.stderr))


def _reason(code: int, stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    checks = [line for line in lines if "Check failed" in line]
    errors = [line for line in lines if "Error" in line and not line.startswith("File ")]
    detail = (checks or errors or lines or ["no output"])[-1]
    detail = re.sub(r"^[FEWI]\d{4} [\d:.]+\s+\d+ ", "", detail)[:300]  # glog's prefix
    if code < 0:
        return f"the XLA compiler crashed (signal {-code}): {detail}"
    return detail


def main(argv: Sequence[str]) -> None:
    topology, measure, load_max, *config_args = argv
    setup_compile_only(topology)
    from loomax.config import parse_config
    from loomax.lm.config import TrainLmConfig
    from loomax.plan.compile import compile_run
    from loomax.plan.topology import get_topology

    path = None
    if config_args[:1] == ["--config_path"]:
        path, config_args = config_args[1], config_args[2:]
    from loomax.plan.rl import is_rl_config

    if is_rl_config(path):
        from loomax.plan.rl import compile_rl
        from loomax.rl.command import rl_config

        result = compile_rl(rl_config(path, config_args), get_topology(topology))
        print(_MARK + json.dumps(result.to_json()), flush=True)
        return
    config = parse_config(TrainLmConfig, path, config_args)
    result = compile_run(
        config,
        get_topology(topology),
        measure_steps=int(measure),
        load_max=float(load_max) if load_max else None,
    )
    print(_MARK + json.dumps(result.to_json()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
