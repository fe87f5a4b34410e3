"""``loomax compile`` and ``loomax plan``: the command lines.

Bad input (an unknown topology, a mesh that does not divide the chips or GPUs, libtpu or
JAX's CUDA plugin missing, a config error) stops with exit code 2 and a clear message before anything compiles;
``compile`` exits 1 when the step does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from loomax.config import ConfigError
from loomax.errors import UserError
from loomax.plan.gpus import GPUS

TOPOLOGY_HELP = (
    "TPU or GPU topology to compile for: a TPU slice, e.g. v5p:4x4x8 (128 chips), v5e:2x2, "
    "v4:4x4x4, v6e:8x8, 2xv5p:4x4x4 (two slices; needs libtpu, the tpu extra); GPU hosts "
    f"NAME:G or NAME:HxG, NAME one of {', '.join(GPUS)}, e.g. h100:8 (one host of 8), "
    "h200:4x8 (4 hosts of 8; needs the gpu-plan extra); or local (the devices present)"
)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", required=True, help=TOPOLOGY_HELP)
    parser.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="N",
        help="with --topology local: also time N real steps (of the top candidates, for plan)",
    )
    parser.add_argument(
        "--load_max",
        type=float,
        default=None,
        metavar="X",
        help="a mixture of experts' measured load, the busiest expert over the mean "
        "(moe/layer_<i>/load_max of a run), for the estimate's load-imbalance term "
        "(default: model.moe.saved_rows)",
    )
    return parser


def _prepare(args: argparse.Namespace, rest: list[str], load: Callable):
    """The run config and the topology, checked before any compile."""
    from loomax.plan.topology import TopologyError, check_topology_name

    try:
        check_topology_name(args.topology)
    except TopologyError as e:
        raise UserError(str(e)) from e
    if args.measure and args.topology != "local":
        raise UserError("--measure times real steps: it needs --topology local")
    if args.load_max is not None and args.load_max < 1:
        raise UserError(
            f"--load_max is the busiest load over the mean: at least 1, got {args.load_max}"
        )
    from loomax.plan.worker import setup_compile_only

    setup_compile_only(args.topology)
    from loomax.lm.config import TrainLmConfig

    config = load(TrainLmConfig, args.config_path, list(rest))
    from loomax.plan.build import vocab_size_of

    vocab_size_of(config)  # a ConfigError without model.vocab_size and a local tokenizer
    topology = _topology_for(config, args.topology)
    return config, topology


COMPILE_DESCRIPTION = (
    "Compile the run's real train step for a TPU or GPU topology (or the local devices) "
    "with abstract arrays, and report memory per chip or GPU, FITS / DOES NOT FIT, FLOPs "
    "per step and an estimated step time and MFU as a range, best / expected / worst, with "
    "its assumptions named (compute, XLA's ops and Pallas kernels alike, at one efficiency "
    "per end; MoE load imbalance; the collectives' bytes over the links; never a "
    "measurement). Exits 1 when the step does not fit."
)
PLAN_DESCRIPTION = (
    "Compile the strategies a researcher would try (mesh data x model x replica, FSDP or "
    "data parallel, tensor parallel, microbatches, gradient checkpointing incl. offload and "
    "kept attention activations) for a TPU or GPU topology, rank those that fit by the "
    "expected end of their estimated step time (a range with its assumptions named; not a "
    "measurement) and write the best as a YAML overlay for loomax train."
)


def compile_command(argv: Sequence[str], parser: argparse.ArgumentParser, load: Callable) -> None:
    """``loomax compile``: compile the run's step for a topology and report memory and speed.

    ``parser`` comes from the CLI (with ``--config_path``); ``load(cls, path, overrides)``
    parses the config; bad input raises ``UserError``."""
    parser.description = textwrap.fill(COMPILE_DESCRIPTION, 88)
    _add_common(parser)
    parser.add_argument(
        "--out", default=None, help="JSON report path (default: compile-TOPOLOGY.json)"
    )
    args, rest = parser.parse_known_args(list(argv))
    from loomax.plan.rl import is_rl_config

    if is_rl_config(args.config_path):
        return _compile_rl(args, rest)
    config, topology = _prepare(args, rest, load)
    from loomax.plan.compile import compile_run
    from loomax.plan.report import compile_text
    from loomax.plan.worker import CompileCrash, compile_isolated

    try:
        if args.topology == "local":
            result = compile_run(
                config, topology, measure_steps=args.measure, load_max=args.load_max
            )
        else:  # in a child process: XLA's TPU or GPU compiler may abort on a program
            result = compile_isolated(
                _config_args(args, rest), args.topology, load_max=args.load_max
            )
    except CompileCrash as e:
        raise UserError(str(e)) from e
    print(compile_text(result))
    out = Path(args.out or f"compile-{_slug(args.topology)}.json")
    out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    print(f"report: {out}")
    if result.fits is False:
        raise SystemExit(1)


def _compile_rl(args: argparse.Namespace, rest: list[str]) -> None:
    """``loomax compile`` of a ``loomax rl`` run (its YAML has an ``rl`` section): the rollout
    and the GRPO update compiled, memory per device for each (``loomax.plan.rl``)."""
    from loomax.plan.topology import TopologyError, check_topology_name

    if args.measure or args.load_max is not None:
        raise UserError("--measure and --load_max are for language-model runs, not loomax rl's")
    try:
        check_topology_name(args.topology)
    except TopologyError as e:
        raise UserError(str(e)) from e
    from loomax.plan.worker import setup_compile_only

    setup_compile_only(args.topology)
    from loomax.plan.rl import compile_rl, rl_text, rl_vocab_size
    from loomax.plan.worker import CompileCrash, compile_isolated
    from loomax.rl.command import rl_config

    config = rl_config(args.config_path, list(rest))
    rl_vocab_size(config)  # a ConfigError before anything compiles
    topology = _topology_for(config, args.topology)
    try:
        if args.topology == "local":
            result = compile_rl(config, topology)
        else:  # in a child process: XLA's TPU or GPU compiler may abort on a program
            result = compile_isolated(_config_args(args, rest), args.topology)
    except CompileCrash as e:
        raise UserError(str(e)) from e
    print(rl_text(result))
    out = Path(args.out or f"compile-{_slug(args.topology)}.json")
    out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    print(f"report: {out}")
    if result.fits is False:
        raise SystemExit(1)


def plan_command(argv: Sequence[str], parser: argparse.ArgumentParser, load: Callable) -> None:
    """``loomax plan``: compile candidate strategies, rank them, write the best as an overlay."""
    from loomax.plan.search import default_jobs

    parser.description = textwrap.fill(PLAN_DESCRIPTION, 88)
    _add_common(parser)
    parser.add_argument("--out", default=None, help="overlay path (default: plan-TOPOLOGY.yaml)")
    parser.add_argument(
        "--jobs", type=int, default=None, help="parallel compiles (default: by cores and memory)"
    )
    parser.add_argument("--max_candidates", type=int, default=24, help="compile at most this many")
    args, rest = parser.parse_known_args(list(argv))
    from loomax.plan.rl import is_rl_config

    if is_rl_config(args.config_path):
        raise UserError(
            f"{args.config_path} is a loomax rl run: `loomax plan` searches language-model "
            "strategies only; `loomax compile` compiles its rollout and update and reports "
            "the memory of each"
        )
    config, topology = _prepare(args, rest, load)
    from loomax.plan.compile import compile_run
    from loomax.plan.report import best, estimate_note, overlay_yaml, plan_json, plan_table
    from loomax.plan.search import search

    jobs = args.jobs or (1 if args.topology == "local" else default_jobs())
    ranked = search(
        config,
        topology,
        jobs=jobs,
        max_candidates=args.max_candidates,
        progress=sys.stderr.isatty(),
        config_args=_config_args(args, rest),
        load_max=args.load_max,
    )
    if args.measure:
        for r in [r for r in ranked if r.result and r.result.fits is not False][:3]:
            r.result = compile_run(
                r.candidate.apply(config),
                topology,
                measure_steps=args.measure,
                load_max=args.load_max,
            )
    print(
        f"{len(ranked)} candidates for {args.topology} ({topology.num_devices} devices), best first:"
    )
    print(plan_table(ranked))
    print(f"note: {estimate_note([r.result for r in ranked])}")
    out = Path(args.out or f"plan-{_slug(args.topology)}.yaml")
    out.with_suffix(".json").write_text(json.dumps(plan_json(ranked), indent=2) + "\n")
    choice = best(ranked)
    if choice is not None and choice.result.assumptions:
        print(f"assumptions of the estimate ({choice.candidate.label}):")
        for line in choice.result.assumptions:
            print(f"  - {line}")
    if choice is None:
        print("no candidate fits: a smaller model, a larger topology or a smaller batch is needed")
        raise SystemExit(1)
    out.write_text(overlay_yaml(choice, args.config_path or "the run", args.topology, len(ranked)))
    print(
        f"best: {choice.candidate.label}; overlay: {out} (all results: {out.with_suffix('.json')})"
    )


def _config_args(args: argparse.Namespace, rest: list[str]) -> list[str]:
    return (["--config_path", args.config_path] if args.config_path else []) + list(rest)


def _slug(name: str) -> str:
    return name.replace(":", "-")


def _topology_for(config, name: str):
    """The topology ``name`` (a UserError if unknown) with ``config``'s mesh resolved over its
    devices (a ConfigError naming the topology if it does not fit)."""
    from loomax.plan.topology import TopologyError, get_topology

    try:
        topology = get_topology(name)
    except TopologyError as e:
        raise UserError(str(e)) from e
    try:
        config.trainer.mesh.resolve(topology.num_devices)
    except ConfigError as e:
        raise ConfigError(f"{e} (topology {name})") from e
    return topology
