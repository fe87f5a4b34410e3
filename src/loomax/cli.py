"""``loomax train|bench``: the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from loomax.config import ConfigError, parse_config

COMMANDS = {
    "train": "train a language model: loomax train --config_path FILE [--section.field VALUE ...]",
    "cache": "tokenize the data into the token cache with Ray: loomax cache --config_path FILE [--overwrite]",
    "tokenizer": "train a byte-level BPE on a config's train sources: loomax tokenizer train --config_path FILE --out DIR",
    "bench": "time the jitted train step on synthetic data: loomax bench --config_path FILE [--steps N] [--save_every K]",
    "export": "write a checkpoint as a Hugging Face directory (safetensors, config.json): loomax export --checkpoint PATH --out DIR",
    "generate": "sample text from a checkpoint with a KV cache: loomax generate --checkpoint PATH --prompt TEXT [--temperature T] [--top_k K] [--top_p P]",
    "eval": "loss, perplexity, bits per byte per validation set: loomax eval --checkpoint PATH [--config_path FILE]",
    "launch": "run a command on a TPU pod, GPU hosts, SLURM or N local processes: loomax launch --target T [--dry-run] -- train ...",
    "schedule": "print a config's learning-rate phases and plot them: loomax schedule --config_path FILE [--out lr.png]",
    "compile": "compile the run's step for a TPU topology on this host: memory per chip, FITS?, est. MFU: loomax compile --config_path FILE --topology v5p:4x4x8",
    "plan": "rank sharding strategies for a topology by compiling each, write the best as an overlay: loomax plan --config_path FILE --topology v5p:4x4x8",
    "ladder": "a family of model sizes with scaling-law budgets: loomax ladder dry-run|run|results --config_path LADDER.yaml [--size 30M]",
}


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``loomax`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        usage = "usage: loomax COMMAND [options]\n\ncommands:\n" + "\n".join(
            f"  {name:<7} {text}" for name, text in COMMANDS.items()
        )
        print(usage, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    command, rest = argv[0], argv[1:]
    if command == "train":
        _train(rest)
    elif command == "bench":
        _bench(rest)
    elif command == "tokenizer":
        _tokenizer(rest)
    elif command == "cache":
        _cache(rest)
    elif command in ("export", "generate", "eval"):
        from loomax import model_cli

        getattr(model_cli, f"{command}_command")(rest, main_error)
    elif command == "launch":
        _launch(rest)
    elif command == "schedule":
        _schedule(rest)
    elif command in ("compile", "plan"):
        from loomax.plan import command as plan_cli

        getattr(plan_cli, f"{command}_command")(rest, _load, main_error)
    elif command == "ladder":
        from loomax.ladder.command import ladder_command

        ladder_command(rest, load=_load, error=main_error)


def main_error(message: str) -> None:
    """Print a usage error and exit with code 2 (before any work was done)."""
    print(f"loomax: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _split_config_path(args: list[str]) -> tuple[str | None, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config_path", default=None)
    known, rest = parser.parse_known_args(args)
    return known.config_path, rest


def _load(cls, args: list[str]):
    config_path, rest = _split_config_path(args)
    try:
        return parse_config(cls, config_path, rest)
    except ConfigError as e:
        main_error(str(e))


def _train(args: list[str]) -> None:
    from loomax.checkpoint import CheckpointError
    from loomax.train_lm import TrainLmConfig, train_lm

    config = _load(TrainLmConfig, args)
    try:
        result = train_lm(config)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        main_error(str(e))
    evals = result.evals
    if evals:
        first, last = evals[0], evals[-1]
        print(
            f"eval loss: step {first[0]}: {first[1]['eval/loss']:.4f} -> step {last[0]}: {last[1]['eval/loss']:.4f}"
        )
    if result.sample is not None:
        print("sample:\n" + "-" * 60 + "\n" + result.sample + "\n" + "-" * 60)
    print(f"metrics: {result.run_dir / 'metrics.jsonl'}")


def _cache(args: list[str]) -> None:
    from loomax.data.dataset import build_caches, prepare_tokenizer
    from loomax.data.token_cache import TokenCacheError
    from loomax.train_lm import TrainLmConfig

    overwrite = "--overwrite" in args
    config = _load(TrainLmConfig, [a for a in args if a != "--overwrite"])
    try:
        tokenizer = prepare_tokenizer(config.data)
        train, validation = build_caches(
            config.data, tokenizer, ray=config.trainer.ray, overwrite=overwrite
        )
    except (ValueError, FileNotFoundError, TokenCacheError) as e:
        main_error(str(e))
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


def _tokenizer(args: list[str]) -> None:
    from loomax.data.sources import iter_documents
    from loomax.data.tokenizer import train_bpe_tokenizer
    from loomax.train_lm import TrainLmConfig

    if not args or args[0] != "train":
        main_error("usage: loomax tokenizer train --config_path FILE --out DIR [--vocab_size N]")
    parser = argparse.ArgumentParser(prog="loomax tokenizer train", add_help=False)
    parser.add_argument("--out", required=True, help="directory (or .json path) to write")
    parser.add_argument(
        "--vocab_size", type=int, default=None, help="default: data.tokenizer_vocab_size"
    )
    try:
        known, rest = parser.parse_known_args(args[1:])
    except SystemExit:
        main_error("loomax tokenizer train needs --out DIR")
    config = _load(TrainLmConfig, rest)
    out = Path(known.out)
    out = out if out.suffix == ".json" else out / "tokenizer.json"
    vocab = known.vocab_size or config.data.tokenizer_vocab_size
    try:
        documents = (doc for source in config.data.train for doc in iter_documents(source))
        tokenizer = train_bpe_tokenizer(documents, vocab, out)
    except (ValueError, FileNotFoundError) as e:
        main_error(str(e))
    print(f"trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens: {out}")


def _bench(args: list[str]) -> None:
    from loomax.benchmark import run_benchmark
    from loomax.train_lm import TrainLmConfig

    parser = argparse.ArgumentParser(prog="loomax bench", add_help=False)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warmup")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps after the compile step"
    )
    parser.add_argument(
        "--save_every",
        type=int,
        default=None,
        help="also time the steps with an async checkpoint every K steps",
    )
    known, rest = parser.parse_known_args(args)
    config = _load(TrainLmConfig, rest)
    try:
        run_benchmark(config, steps=known.steps, warmup=known.warmup, save_every=known.save_every)
    except ValueError as e:
        main_error(str(e))


def _launch(args: list[str]) -> None:
    from loomax.launch import LaunchConfig, defaults_file, launch, split_launch_args

    try:
        options, command = split_launch_args(args)
        path, options = defaults_file(options)
    except ValueError as e:
        main_error(str(e))
    if command[0] not in COMMANDS or command[0] == "launch":
        main_error(f"loomax launch: {command[0]!r} is not a loomax command ({', '.join(COMMANDS)})")
    try:
        config = parse_config(LaunchConfig, path, options)
    except (ConfigError, ValueError) as e:
        main_error(str(e))
    try:
        code = launch(config, command)
    except (ValueError, FileNotFoundError) as e:
        main_error(str(e))
    raise SystemExit(code)


def _schedule(args: list[str]) -> None:
    from loomax.batch_schedule import BatchSchedule
    from loomax.optim.plot import plot_schedule
    from loomax.train_lm import TrainLmConfig

    parser = argparse.ArgumentParser(prog="loomax schedule", add_help=False)
    parser.add_argument("--out", default="lr.png", help="PNG to write (matplotlib)")
    known, rest = parser.parse_known_args(args)
    config = _load(TrainLmConfig, rest)
    steps = config.trainer.num_train_steps
    try:
        batches = BatchSchedule(config.trainer.train_batch_size)
        schedule = config.optimizer.lr_scheduler(steps, batches)
    except ValueError as e:
        main_error(str(e))
    print(f"optimizer.type {type(config.optimizer).__name__}, {steps} steps:")
    for phase in schedule.phases():
        print(f"  {phase}")
    try:
        out = plot_schedule(schedule, steps, known.out)
    except ImportError as e:
        main_error(str(e))
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
