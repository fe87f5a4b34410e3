"""``loomax export|generate|eval --checkpoint PATH``: the commands that use a trained model.

Each command gets its ``argparse`` parser from ``loomax.cli`` (errors are one-line
``UserError``s there) and adds its own options.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from contextlib import AbstractContextManager

from loomax.errors import UserError

Guard = Callable[[], AbstractContextManager]
"""``loomax.cli_parser.config_errors``: makes config and flag errors one-line ``UserError``s."""


def _parse(parser: argparse.ArgumentParser, args: list[str]):
    parser.add_argument(
        "--checkpoint",
        "--model",
        dest="checkpoint",
        required=True,
        metavar="PATH",
        help="saved model, HF directory or trainer checkpoint (--model is the same)",
    )
    parser.add_argument(
        "--config_path",
        default=None,
        metavar="FILE",
        help="the run's config (default: config.yaml above a trainer checkpoint)",
    )
    parser.epilog = (
        "Other --section.field VALUE flags override the run's config (docs/reference/config.md)."
    )
    parser.overrides = True  # type: ignore[attr-defined]  # usage ends with the overrides
    return parser.parse_known_args(args)  # the rest: --section.key VALUE overrides


def _load(known, overrides: list[str], guard: Guard, *, merge_adapters: bool = True):
    from loomax.inference import load_for_inference

    with guard():
        return load_for_inference(
            known.checkpoint,
            config_path=known.config_path,
            overrides=overrides,
            merge_adapters=merge_adapters,
        )


def export_command(args: list[str], parser: argparse.ArgumentParser, guard: Guard) -> None:
    """Write a checkpoint as a Hugging Face directory (safetensors + config.json + tokenizer)."""
    from loomax.hf import export_hf, special_token_ids

    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument(
        "--max_shard_gb", type=float, default=5.0, help="safetensors shard size limit"
    )
    parser.add_argument(
        "--peft",
        default=None,
        metavar="DIR",
        help="a LoRA run: write its adapters there as a PEFT adapter, and the base (no "
        "adapters) to --out; default: the adapters merged into the model at --out",
    )
    known, overrides = _parse(parser, args)
    loaded = _load(known, overrides, guard, merge_adapters=known.peft is None)
    special = {}
    if loaded.tokenizer is not None:
        from loomax.data.tokenizer import load_tokenizer

        special = special_token_ids(load_tokenizer(loaded.tokenizer))
    settings = dict(
        tokenizer=loaded.tokenizer,
        special_tokens=special,
        max_shard_bytes=int(known.max_shard_gb * 1024**3),
        chat_template=_export_template(loaded),
    )
    if known.peft is not None:
        from loomax.hf.peft import export_base_and_adapter

        with guard():
            export_base_and_adapter(loaded.model, known.out, known.peft, **settings)
        print(f"exported {loaded.description} -> base {known.out}, PEFT adapter {known.peft}")
        return
    out = export_hf(loaded.model, known.out, **settings)
    print(f"exported {loaded.description} -> {out}")


def generate_command(args: list[str], parser: argparse.ArgumentParser, guard: Guard) -> None:
    """Sample a continuation of ``--prompt`` with the KV cache."""
    import jax

    from loomax.models.decoding.generate import sample_tokens

    parser.add_argument("--prompt", default=None, help="text to continue")
    parser.add_argument(
        "--chat", default=None,
        help="a conversation to answer instead of --prompt: JSON turns [{role, content}] or a "
        "file of them, rendered with the chat template and its generation prompt",
    )  # fmt: skip
    parser.add_argument(
        "--chat_template", default=None,
        help="for --chat: loomax | chatml | a .jinja or tokenizer_config.json (default: the "
        "run's data.chat.template, else the tokenizer folder's, else loomax)",
    )  # fmt: skip
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument(
        "--repetition_penalty", type=float, default=None, help="CTRL's penalty (e.g. 1.2)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's)"
    )
    parser.add_argument("--no_stop", action="store_true", help="do not stop at EOS")
    parser.add_argument(
        "--context", type=int, default=1,
        help="prefill the prompt split over this many devices (a long prompt; docs/sharding.md)",
    )  # fmt: skip
    known, overrides = _parse(parser, args)
    if (known.prompt is None) == (known.chat is None):
        parser.error("give one of --prompt and --chat")
    _check_sampling(known)
    mesh = _context_mesh(known.context)
    loaded = _load(known, overrides, guard)
    path = known.tokenizer or loaded.tokenizer
    if path is None:
        raise UserError(f"{loaded.description} has no tokenizer: pass --tokenizer tokenizer.json")
    from loomax.data.tokenizer import eos_id, load_tokenizer

    tokenizer = load_tokenizer(path)
    if known.chat is not None:
        prompt = _chat_prompt(known, loaded, tokenizer, path)
    else:
        prompt = tokenizer.encode(known.prompt).ids
    if not prompt:
        raise UserError("--prompt encodes to no tokens")
    tokens = sample_tokens(
        loaded.model,
        prompt,
        seq_len=loaded.model.config.seq_len,
        max_new_tokens=known.max_new_tokens,
        temperature=known.temperature,
        top_k=known.top_k,
        top_p=known.top_p,
        repetition_penalty=known.repetition_penalty,
        key=jax.random.PRNGKey(known.seed),
        stop_token=None if known.no_stop else eos_id(tokenizer),
        mesh=mesh,
    )
    print(tokenizer.decode(tokens))


def _chat_prompt(known, loaded, tokenizer, path) -> list[int]:
    """``--chat``'s conversation rendered with its template, ready for the answer."""
    from loomax.data.chat.encode import load_template, prompt_ids, read_chat_arg

    spec = known.chat_template
    run = loaded.run_config
    if spec is None and run is not None and run.data.format == "chat":
        spec = run.data.chat.template
    return prompt_ids(read_chat_arg(known.chat), load_template(spec, tokenizer, path), tokenizer)


def _export_template(loaded) -> str | None:
    """The chat template an export writes beside the tokenizer: a chat run's own
    (``data.chat.template``), else the tokenizer folder's; None without either."""
    from loomax.data.chat.encode import folder_template, load_template
    from loomax.data.tokenizer import load_tokenizer

    run = loaded.run_config
    if loaded.tokenizer is None:
        return None
    if run is not None and run.data.format == "chat":
        spec = run.data.chat.template
        return load_template(spec, load_tokenizer(loaded.tokenizer), loaded.tokenizer).source
    own = folder_template(loaded.tokenizer)
    return None if own is None else own.source


def _context_mesh(context: int):
    """The mesh a ``--context`` split prefill runs on (context x data over every device), or
    None for 1; a one-line ``UserError`` when it does not divide the devices."""
    import jax

    from loomax.mesh import MeshConfig

    devices = jax.device_count()
    if context < 1 or devices % context:
        raise UserError(f"--context {context} must be a positive divisor of the {devices} devices")
    return MeshConfig(context=context).build() if context > 1 else None


def _check_sampling(known) -> None:
    """The sampling flags ``sample_tokens`` would refuse, as one-line ``UserError``s."""
    if known.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {known.temperature}")
    if known.top_k is not None and known.top_k <= 0:
        raise UserError(f"--top_k must be positive, got {known.top_k}")
    if known.repetition_penalty is not None and known.repetition_penalty <= 0:
        raise UserError(f"--repetition_penalty must be > 0, got {known.repetition_penalty}")
    if known.top_p is not None and not 0 < known.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1], got {known.top_p}")


def eval_command(args: list[str], parser: argparse.ArgumentParser, guard: Guard) -> None:
    """Loss, perplexity and bits per byte per validation set, and their macro average."""
    from loomax.inference import evaluate

    parser.add_argument(
        "--batch_size", type=int, default=None, help="default: trainer.eval_batch_size"
    )
    parser.add_argument(
        "--max_batches", type=int, default=None, help="per set (default: trainer.max_eval_batches)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    tasks = parser.add_argument_group(
        "lm-eval tasks (the `eval` extra; docs/downstream.md)",
        "With --tasks, run lm-eval's evaluator on the model instead of the validation sets.",
    )
    tasks.add_argument("--tasks", default=None, metavar="T1,T2", help="lm-eval task names")
    tasks.add_argument(
        "--include_path",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of task YAMLs (repeatable)",
    )
    tasks.add_argument(
        "--no_default_tasks", action="store_true", help="only the tasks of --include_path"
    )
    tasks.add_argument(
        "--prepared",
        default=None,
        metavar="DIR",
        help="a task set made by `loomax eval prepare` (lm-eval's own tasks read only this)",
    )
    tasks.add_argument("--limit", type=float, default=None, metavar="N", help="documents per task")
    tasks.add_argument("--num_fewshot", type=int, default=None, metavar="K")
    tasks.add_argument("--out", default=None, metavar="FILE", help="write lm-eval's results JSON")
    tasks.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's)"
    )
    tasks.add_argument("--seed", type=int, default=0)
    known, overrides = _parse(parser, args)
    for flag in ("batch_size", "max_batches"):
        if getattr(known, flag) is not None and getattr(known, flag) < 1:
            raise UserError(f"--{flag} must be >= 1, got {getattr(known, flag)}")
    if known.tasks is not None:
        _eval_tasks(known, overrides, guard)
        return
    for flag in ("include_path", "prepared", "limit", "num_fewshot", "out", "tokenizer"):
        if getattr(known, flag):
            raise UserError(f"--{flag} needs --tasks")
    loaded = _load(known, overrides, guard)
    results = evaluate(loaded, batch_size=known.batch_size, max_batches=known.max_batches)
    if known.json:
        print(json.dumps(results, sort_keys=True))
        return
    print(f"{loaded.description}")
    rows = sorted({k.rsplit("/", 1)[0] for k in results})
    print(f"{'set':<24} {'loss':>8} {'ppl':>10} {'bpb':>8}")
    for row in [r for r in rows if r != "eval"] + ["eval"]:
        name = "macro average" if row == "eval" else row.removeprefix("eval/")
        bpb = results.get(f"{row}/bpb")
        print(
            f"{name:<24} {results[row + '/loss']:>8.4f} {results[row + '/perplexity']:>10.3f} "
            f"{'' if bpb is None else f'{bpb:>8.4f}'}"
        )


def _eval_tasks(known, overrides: list[str], guard: Guard) -> None:
    """``loomax eval --tasks``: lm-eval's evaluator on the model (loomax.downstream)."""
    from loomax.downstream import (
        lm_eval_model,
        require_lm_eval,
        run_tasks,
        task_manager,
        write_results,
    )

    require_lm_eval()  # before loading the model
    tasks, limit = _task_list(known.tasks), _limit(known.limit)
    manager = task_manager(
        tasks,
        known.include_path,
        include_defaults=not known.no_default_tasks,
        prepared=known.prepared,
    )
    loaded = _load(known, overrides, guard)
    path = known.tokenizer or loaded.tokenizer
    if path is None:
        raise UserError(f"{loaded.description} has no tokenizer: pass --tokenizer tokenizer.json")
    lm = lm_eval_model(loaded.model, path, batch_size=known.batch_size or 8, seed=known.seed)
    results = run_tasks(
        lm,
        tasks,
        manager,
        prepared=known.prepared,
        limit=limit,
        num_fewshot=known.num_fewshot,
        seed=known.seed,
    )
    if known.out:
        print(f"results: {write_results(results, known.out)}")
    if known.json:
        print(json.dumps(results.get("results", {}), sort_keys=True, default=str))
        return
    print(f"{loaded.description}")
    for task, metrics in sorted(results.get("results", {}).items()):
        for name, value in sorted(metrics.items()):
            if name == "alias" or "_stderr" in name or not isinstance(value, int | float):
                continue
            print(f"{task:<24} {name:<28} {value:>10.4f}")


def _task_list(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks needs at least one task name")
    return tasks


def _limit(limit: float | None) -> int | float | None:
    if limit is not None and limit <= 0:
        raise UserError(f"--limit must be > 0, got {limit}")
    return int(limit) if limit is not None and limit >= 1 else limit  # < 1: a fraction


PREPARE_HELP = (
    "render lm-eval tasks once (documents and requests) into a local, versioned task set that "
    "`loomax eval --prepared DIR` and the downstream_eval hook read offline"
)


def eval_prepare_command(args: list[str], parser: argparse.ArgumentParser) -> None:
    """``loomax eval prepare``: lm-eval tasks into a prepared set (loomax.downstream.prepared)."""
    from loomax.downstream import require_lm_eval, task_manager
    from loomax.downstream.prepared import prepare_tasks

    parser.add_argument(
        "--tasks", required=True, metavar="T1,T2", help="lm-eval task or group names"
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="the task set to write or add to"
    )
    parser.add_argument(
        "--include_path",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of task YAMLs (repeatable)",
    )
    parser.add_argument(
        "--limit",
        type=float,
        default=None,
        metavar="N",
        help="documents rendered in requests.jsonl",
    )
    parser.add_argument("--num_fewshot", type=int, default=None, metavar="K")
    parser.add_argument(
        "--seed", type=int, default=0, help="few-shot sampling seed of the requests"
    )
    known = parser.parse_args(args)
    require_lm_eval()
    tasks, limit = _task_list(known.tasks), _limit(known.limit)
    manager = task_manager(tasks, known.include_path, where="--tasks", prepared=None, hub=True)
    written = prepare_tasks(
        tasks, known.out, manager, limit=limit, num_fewshot=known.num_fewshot, seed=known.seed
    )
    print(f"{'task':<28} {'version':>8} {'documents':>24} {'requests':>9}")
    for name, entry in sorted(written.items()):
        docs = " ".join(f"{s}:{e['rows']}" for s, e in entry["splits"].items())
        print(f"{name:<28} {entry['version']!s:>8} {docs:>24} {entry['requests']['rows']:>9}")
    print(f"prepared {len(written)} task(s) in {known.out}")
