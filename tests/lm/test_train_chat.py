"""`loomax train` with `data.format: chat`: the pretraining trainer fine-tunes on conversations."""

from __future__ import annotations

import json

import pytest

from loomax.cli import main
from loomax.config import parse_config
from loomax.lm import TrainLmConfig
from loomax.train_lm import train_lm


@pytest.mark.slow
def test_chat_sft_trains_and_evaluates_the_assistant_loss(tmp_path, repo_root, capsys, monkeypatch):
    folder = repo_root / "data" / "chat_tiny"
    with open(folder / "train.jsonl") as f:
        (tmp_path / "chats.jsonl").write_text("".join(next(f) for _ in range(200)))
    args = [
        "--config_path", str(repo_root / "config" / "sft_tiny.yaml"),
        "--data.tokenizer", str(folder / "tokenizer.json"),
        "--data.train", json.dumps([{"urls": [str(tmp_path / "chats.jsonl")]}]),
        "--data.validation_fraction", "0.1",
        "--model.seq_len", "128", "--model.hidden_dim", "32", "--model.intermediate_dim", "64",
        "--model.num_layers", "2", "--model.num_heads", "2", "--model.num_kv_heads", "1",
        "--trainer.num_train_steps", "12", "--trainer.train_batch_size", "8",
        "--trainer.steps_per_eval", "12", "--trainer.progress_bar", "false",
        "--trainer.run_dir", str(tmp_path / "run"), "--optimizer.warmup", "2",
        "--optimizer.learning_rate", "0.01", "--sample.max_new_tokens", "4",
    ]  # fmt: skip
    config = parse_config(TrainLmConfig, None, args)
    assert config.data.format == "chat" and config.data.chat.loss_on == "assistant"
    result = train_lm(config)
    assert result.final.step == 12
    (first, start), (last, end) = result.evals[0], result.evals[-1]
    assert (first, last) == (0, 12)
    assert end["eval/loss"] < 0.8 * start["eval/loss"]  # the held-out assistant tokens' loss
    assert "eval/perplexity" in end and "eval/bpb" not in end  # no bytes over masked tokens
    # `loomax generate --chat` renders the conversation with the run's template
    monkeypatch.chdir(repo_root)
    capsys.readouterr()  # the run's own output
    chat = json.dumps([{"role": "user", "content": "Add 2 and 3."}])
    greedy = ["--temperature", "0", "--max_new_tokens", "3", "--no_stop"]
    main(
        ["generate", "--checkpoint", str(tmp_path / "run" / "checkpoints"), "--chat", chat, *greedy]
    )
    assert capsys.readouterr().out.startswith("<user>\nAdd 2 and 3.\n<assistant>\n")
    # `loomax eval` on the chat run's checkpoint: the held-out assistant loss of the last eval
    main(["eval", "--checkpoint", str(tmp_path / "run" / "checkpoints"), "--json"])
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["eval/loss"] == pytest.approx(end["eval/loss"], rel=1e-4)
    assert "eval/bpb" not in results
