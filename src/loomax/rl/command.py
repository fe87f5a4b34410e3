"""``loomax rl``: parse the run's ``TrainRlConfig``, train, and print what it reached."""

from __future__ import annotations

from loomax.cli_parser import config_errors, given_values, load_config, steps_line
from loomax.rl.config import TrainRlConfig


def rl_config(config_path: str | None, overrides: list[str]) -> TrainRlConfig:
    """The run's ``TrainRlConfig``; with ``trainer.initialize_from_hf`` its ``model`` is the
    checkpoint config.json's, the model keys the run sets itself winning (as ``loomax dpo``)."""
    from loomax.lm import hf_source, hf_type_args, with_hf_model

    with config_errors():
        given = given_values(TrainRlConfig, config_path, overrides)
    type_args = hf_type_args(hf_source(given), given)
    return with_hf_model(load_config(TrainRlConfig, config_path, type_args + overrides), given)


def rl_command(args: list[str], parser) -> None:
    """Run ``loomax rl --config_path FILE [--section.key VALUE ...]``."""
    from loomax.rl.run import train_rl

    known, overrides = parser.parse_known_args(args)
    result = train_rl(rl_config(known.config_path, overrides))
    if result.evals:
        (first, a), (last, b) = result.evals[0], result.evals[-1]
        key = "eval/rl/exact_match"
        print(
            f"held-out exact match: step {first}: {100 * a[key]:.1f}% -> step {last}: {100 * b[key]:.1f}%"
        )
    print(f"metrics: {result.run_dir / 'metrics.jsonl'}")
    print(f"model: {result.model_dir}")
    print(steps_line(result.final.step, result.num_train_steps, result.stop_reason))
