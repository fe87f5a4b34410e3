"""``loomax dpo``: parse the run's ``TrainDpoConfig``, train, and print what it reached."""

from __future__ import annotations

from loomax.cli_parser import config_errors, given_values, load_config, steps_line
from loomax.dpo.config import TrainDpoConfig


def dpo_config(config_path: str | None, overrides: list[str]) -> TrainDpoConfig:
    """The run's ``TrainDpoConfig``; with ``trainer.initialize_from_hf`` its ``model`` is the
    checkpoint config.json's, the model keys the run sets itself winning (as ``loomax train``)."""
    from loomax.lm import hf_source, hf_type_args, with_hf_model

    with config_errors():
        given = given_values(TrainDpoConfig, config_path, overrides)
    type_args = hf_type_args(hf_source(given), given)
    return with_hf_model(load_config(TrainDpoConfig, config_path, type_args + overrides), given)


def dpo_command(args: list[str], parser) -> None:
    """Run ``loomax dpo --config_path FILE [--section.key VALUE ...]``."""
    from loomax.dpo.run import train_dpo

    known, overrides = parser.parse_known_args(args)
    config = dpo_config(known.config_path, overrides)
    result = train_dpo(config)
    if result.reference_accuracy is not None:
        print(
            "held-out pairs the reference prefers the chosen response of: "
            f"{100 * result.reference_accuracy:.1f}%"
        )
    if result.evals:
        (first, a), (last, b) = result.evals[0], result.evals[-1]
        key = "eval/dpo/rewards/accuracies"
        print(
            f"eval loss: step {first}: {a['eval/loss']:.4f} -> step {last}: {b['eval/loss']:.4f}; "
            f"held-out {key}: {100 * b[key]:.1f}% at step {last}"
        )
    print(f"metrics: {result.run_dir / 'metrics.jsonl'}")
    print(f"model: {result.model_dir} (loomax export --checkpoint DIR writes it for Hugging Face)")
    print(steps_line(result.final.step, result.num_train_steps, result.stop_reason))
