"""``loomax COMMAND``: the command line.

Every command answers ``-h/--help`` with its own usage on stdout (exit 0). Bad input from
the user (a ``loomax.errors.UserError``, a bad flag) is printed as one line,
``loomax COMMAND: error: MESSAGE``, with exit code 2; a failed run (``TrainingFailure``:
a NaN loss, divergence) is one line too, with exit code 1. Anything else is a bug: its
traceback is printed, then ``loomax COMMAND: internal error (...)``, and the exit code is 1.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from loomax.cli_parser import (  # steps_line: the last line of a training command
    command_parser,
    config_errors,
    given_values,
    load_config,
    steps_line,
)
from loomax.errors import TrainingFailure, UserError

COMMANDS = {
    "train": "train a language model",
    "dpo": "train a model on preference pairs (DPO, IPO, SimPO) on the same trainer",
    "rl": "train a model with verifiable rewards (GRPO, DAPO, Dr. GRPO) on the same trainer",
    "cache": "tokenize the data into the token cache (with Ray)",
    "tokenizer": "train a byte-level BPE on a config's train sources (tokenizer train)",
    "bench": "time the jitted train step on synthetic data",
    "export": "write a checkpoint as a Hugging Face directory (safetensors, config.json)",
    "generate": "sample text from a checkpoint with a KV cache",
    "eval": "loss, perplexity and bits per byte per validation set, or lm-eval --tasks "
    "(eval prepare: render lm-eval tasks into local files)",
    "launch": "run a loomax command on a TPU pod, GPU hosts, SLURM or N local processes",
    "schedule": "print a config's learning-rate phases and plot them",
    "compile": "compile the run's step for TPUs or GPUs here: memory per device, fits?, est. MFU",
    "plan": "rank sharding strategies for a topology by compiling each; write the best overlay",
    "ladder": "a family of model sizes with scaling-law budgets (dry-run|run|results|benchmark)",
    "control": "ask a running job's control server: RUN_DIR status|stop|save|save_and_stop|abort",
}

ACTIONS = {
    "tokenizer": {"train": "train a byte-level BPE on data.train and write tokenizer.json"},
    "ladder": {
        "dry-run": "print each size's model, batch, budget and schedule, and plot its learning rate",
        "run": "train the sizes one after the other",
        "results": "tabulate checkpoints and metrics and fit loss against compute",
        "benchmark": "time one size's train step (no checkpoints, no evals, --steps then stop)",
    },
}


def version() -> str:
    """The installed loomax version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("loomax")
    except PackageNotFoundError:
        return "unknown"


def usage() -> str:
    """``loomax --help``: the commands."""
    lines = ["usage: loomax [-h] [--version] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    lines += [
        "",
        "`loomax COMMAND --help` shows a command's options; config keys are in docs/reference/config.md.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``loomax`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(), file=sys.stderr)
        raise SystemExit(2)
    if argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0)
    if argv[0] in ("-V", "--version"):
        print(f"loomax {version()}")
        raise SystemExit(0)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        what = "option" if command.startswith("-") else "command"
        fail("loomax", f"unknown {what} {command!r} (commands: {', '.join(COMMANDS)})")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    prog = f"loomax {command}"
    if (command in ACTIONS and rest and rest[0] in ACTIONS[command]) or (
        command == "eval" and rest[:1] == ["prepare"]
    ):
        prog += f" {rest[0]}"
    try:
        _run(command, rest)
    except UserError as e:
        fail(prog, str(e))
    except TrainingFailure as e:
        fail(prog, str(e), code=1)
    except Exception as e:
        traceback.print_exc()
        print(f"{prog}: {INTERNAL_ERROR}", file=sys.stderr)
        raise SystemExit(1) from e


INTERNAL_ERROR = "internal error (a bug; please report it with the traceback above)"
"""The last line of a command that failed with an exception other than bad input."""


def fail(prog: str, message: str, code: int = 2) -> None:
    """Print ``PROG: error: MESSAGE`` as one line on stderr and exit with ``code``."""
    one_line = " ".join(message.split()) or "error"
    print(f"{prog}: error: {one_line}", file=sys.stderr)
    raise SystemExit(code)


def _run(command: str, args: list[str]) -> None:
    if command in ACTIONS:
        args = _action(command, args)
    if command == "eval" and args[:1] == ["prepare"]:
        from loomax import model_cli

        parser = command_parser("eval prepare", model_cli.PREPARE_HELP)
        model_cli.eval_prepare_command(args[1:], parser)
    elif command in ("export", "generate", "eval"):
        from loomax import model_cli

        run = getattr(model_cli, f"{command}_command")
        run(args, command_parser(command, COMMANDS[command]), config_errors)
    elif command in ("compile", "plan"):
        from loomax.plan import command as plan_cli

        run = getattr(plan_cli, f"{command}_command")
        run(args, command_parser(command, COMMANDS[command], config=True), load_config)
    elif command == "dpo":
        from loomax.dpo.command import dpo_command

        dpo_command(args, command_parser("dpo", COMMANDS["dpo"], config=True))
    elif command == "rl":
        from loomax.rl.command import rl_command

        rl_command(args, command_parser("rl", COMMANDS["rl"], config=True))
    elif command == "ladder":
        from loomax.ladder.command import ladder_command

        action, rest = args[0], args[1:]
        parser = command_parser(f"ladder {action}", ACTIONS["ladder"][action], config=True)
        ladder_command(action, rest, parser=parser, load=load_config)
    else:
        globals()[f"_{command}"](args)


def _action(command: str, args: list[str]) -> list[str]:
    """Check the action of ``loomax tokenizer|ladder ACTION``; answer ``--help`` without one."""
    actions = ACTIONS[command]
    if args and args[0] in ("-h", "--help"):
        lines = [
            f"usage: loomax {command} {{{','.join(actions)}}} [options]",
            "",
            COMMANDS[command],
        ]
        lines += ["", "actions:"] + [f"  {name:<8} {text}" for name, text in actions.items()]
        lines += ["", f"`loomax {command} ACTION --help` shows an action's options."]
        print("\n".join(lines))
        raise SystemExit(0)
    if not args or args[0] not in actions:
        got = f"unknown action {args[0]!r}" if args else "missing action"
        raise UserError(f"{got}: usage: loomax {command} {'|'.join(actions)} [options]")
    return args


def _train(args: list[str]) -> None:
    from loomax.train_lm import train_lm

    parser = command_parser("train", COMMANDS["train"], config=True)
    known, overrides = parser.parse_known_args(args)
    config = _run_config(known.config_path, overrides)
    if config.trainer.mesh.auto or config.trainer.force_strategy is not None:
        from loomax.plan.auto import choose_strategy

        config = choose_strategy(config)  # trainer.mesh.auto, trainer.force_strategy
    result = train_lm(config)
    evals = result.evals
    if evals:
        first, last = evals[0], evals[-1]
        print(
            f"eval loss: step {first[0]}: {first[1]['eval/loss']:.4f} -> step {last[0]}: {last[1]['eval/loss']:.4f}"
        )
        _print_gzip_baseline(config, last[1].get("eval/bpb"))
    if result.sample is not None:
        print("sample:\n" + "-" * 60 + "\n" + result.sample + "\n" + "-" * 60)
    print(f"metrics: {result.run_dir / 'metrics.jsonl'}")
    print(steps_line(result.final.step, result.num_train_steps, result.stop_reason))


def _run_config(config_path: str | None, overrides: list[str]):
    """The run's ``TrainLmConfig``; with ``trainer.initialize_from_hf``, its ``model`` is
    the checkpoint config.json's, the model keys the run sets itself winning."""
    from loomax.lm import TrainLmConfig, hf_source, hf_type_args, with_hf_model

    with config_errors():
        given = given_values(TrainLmConfig, config_path, overrides)
    type_args = hf_type_args(hf_source(given), given)  # parsed with config.json's family
    return with_hf_model(load_config(TrainLmConfig, config_path, type_args + overrides), given)


def _print_gzip_baseline(config, bpb: float | None) -> None:
    """The demo's bar: held-out bits per byte beside gzip -9's on the same held-out files
    (only for the embedded corpus, whose held-out files are cheap to read again)."""
    data = config.data
    if bpb is None or not data.train or any(s.embedded is None for s in data.train):
        return
    from loomax.data.gzip_baseline import gzip_bits_per_byte, held_out_documents

    documents = held_out_documents(data)
    gzip_bpb = gzip_bits_per_byte(documents)
    if gzip_bpb is not None:
        verdict = "beats" if bpb < gzip_bpb else "does not beat"
        print(
            f"held-out bits per byte: {bpb:.3f} (model) vs {gzip_bpb:.3f} (gzip -9, each of the "
            f"{len(documents)} held-out files alone): the model {verdict} gzip"
        )


def _cache(args: list[str]) -> None:
    from loomax.data.dataset import build_caches
    from loomax.data.report import skipped_lines, skipped_records
    from loomax.data.run_tokenizer import prepare_tokenizer
    from loomax.data.sources import check_source_files
    from loomax.lm import TrainLmConfig

    parser = command_parser("cache", COMMANDS["cache"], config=True)
    parser.add_argument(
        "--overwrite", action="store_true", help="rebuild caches that exist already"
    )
    known, overrides = parser.parse_known_args(args)
    config = load_config(TrainLmConfig, known.config_path, overrides)
    check_source_files(config.data.train, config.data.validation)
    tokenizer = prepare_tokenizer(config.data)
    train, validation = build_caches(
        config.data, tokenizer, ray=config.trainer.ray, overwrite=known.overwrite
    )
    print(f"tokenizer: {tokenizer}")
    for kind, infos in (("train", train), ("validation", validation)):
        for i, info in enumerate(infos):
            splits = ", ".join(
                f"{name} {s.documents:,} documents / {s.tokens:,} tokens"
                for name, s in info.splits.items()
            )
            skipped = (
                f", {info.documents_skipped} bad records skipped" if info.documents_skipped else ""
            )
            print(
                f"data.{kind}[{i}]: {splits}{skipped}; {info.shards_tokenized} of {info.shards_total} shards "
                f"tokenized now -> {info.url}"
            )
        for line in skipped_lines(skipped_records(kind, infos)):
            print(line)


def _tokenizer(args: list[str]) -> None:
    from loomax.data.run_tokenizer import tokenizer_documents
    from loomax.data.tokenizer import MIN_VOCAB_SIZE, train_bpe_tokenizer
    from loomax.lm import TrainLmConfig

    parser = command_parser("tokenizer train", ACTIONS["tokenizer"]["train"], config=True)
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="directory (or .json path) to write"
    )
    parser.add_argument(
        "--vocab_size", type=int, metavar="N", help="default: data.tokenizer_vocab_size"
    )
    known, overrides = parser.parse_known_args(args[1:])
    config = load_config(TrainLmConfig, known.config_path, overrides)
    out = Path(known.out)
    out = out if out.suffix == ".json" else out / "tokenizer.json"
    vocab = known.vocab_size or config.data.tokenizer_vocab_size
    if vocab < MIN_VOCAB_SIZE:
        raise UserError(f"--vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab}")
    # the documents the train split keeps: validation text must not shape the vocabulary
    tokenizer = train_bpe_tokenizer(tokenizer_documents(config.data), vocab, out)
    print(f"trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens: {out}")


def _bench(args: list[str]) -> None:
    from loomax.benchmark import run_benchmark

    parser = command_parser("bench", COMMANDS["bench"], config=True)
    parser.add_argument(
        "--steps", type=int, default=10, metavar="N", help="timed steps after warmup"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, metavar="N", help="untimed steps after the compile step"
    )
    parser.add_argument(
        "--save_every",
        type=int,
        default=None,
        metavar="K",
        help="also time the steps with an async checkpoint every K steps",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after timing, trace a few steps into DIR (xplane and Perfetto trace.json.gz)",
    )
    known, overrides = parser.parse_known_args(args)
    config = _run_config(known.config_path, overrides)
    run_benchmark(
        config,
        steps=known.steps,
        warmup=known.warmup,
        save_every=known.save_every,
        profile_dir=known.profile,
    )


def _launch_help() -> str:
    from loomax.config_reference import field_docs
    from loomax.launch import LaunchConfig

    parser = command_parser("launch", COMMANDS["launch"])
    parser.usage = (
        "loomax launch [--target T] [--option VALUE ...] [--dry-run] -- COMMAND [ARGS ...]"
    )
    parser.epilog = (
        "Defaults come from .loomax.yaml here (or --launch_config FILE); flags override them.\n"
        "Everything after `--` is the loomax command to run, e.g. `-- train --config_path FILE`.\n"
        "See docs/launching.md."
    )
    parser.add_argument("--launch_config", metavar="FILE", help="launch defaults (YAML)")
    defaults = LaunchConfig()
    for name, doc in field_docs(LaunchConfig).items():
        flag, text = f"--{name}", doc.replace("%", "%%")
        if isinstance(getattr(defaults, name), bool):
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, metavar="VALUE", help=text)
    return parser.format_help()


def _launch(args: list[str]) -> None:
    from loomax.launch import LaunchConfig, defaults_file, launch, split_launch_args

    options_part = args[: args.index("--")] if "--" in args else args
    if "-h" in options_part or "--help" in options_part:
        print(_launch_help(), end="")
        raise SystemExit(0)
    options, command = split_launch_args(args)
    path, options = defaults_file(options)
    if command[0] not in COMMANDS or command[0] == "launch":
        raise UserError(f"{command[0]!r} is not a loomax command ({', '.join(COMMANDS)})")
    config = load_config(LaunchConfig, path, options)
    raise SystemExit(launch(config, command))


def _control(args: list[str]) -> None:
    import json

    from loomax.hooks.control_client import ACTIONS, send

    parser = command_parser("control", COMMANDS["control"])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds control.json)")
    parser.add_argument("action", choices=ACTIONS, help="what to ask")
    known = parser.parse_args(args)
    print(json.dumps(send(known.run_dir, known.action), indent=1))


def _schedule(args: list[str]) -> None:
    from loomax.lm import TrainLmConfig
    from loomax.optim.plot import plot_schedule

    parser = command_parser("schedule", COMMANDS["schedule"], config=True)
    parser.add_argument(
        "--out", default="lr.png", metavar="PNG", help="PNG to write (matplotlib; default lr.png)"
    )
    known, overrides = parser.parse_known_args(args)
    config = load_config(TrainLmConfig, known.config_path, overrides)
    steps = config.trainer.num_train_steps
    schedule = config.optimizer.lr_scheduler(steps, config.trainer.batch_schedule)
    print(f"optimizer.type {type(config.optimizer).__name__}, {steps} steps:")
    for phase in schedule.phases():
        print(f"  {phase}")
    out = plot_schedule(schedule, steps, known.out)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
