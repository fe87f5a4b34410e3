"""`loomax train` with `data.format: chat`: the pretraining trainer fine-tunes on conversations;
the SFT'd model answers the same in Loomax and, exported, in transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loomax.cli import main
from loomax.config import parse_config
from loomax.lm import TrainLmConfig
from loomax.train_lm import train_lm

QUESTION = [{"role": "user", "content": "Add 2 and 3."}]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, repo_root):
    """12 steps of a tiny Llama on 180 of the shipped conversations (20 held out)."""
    tmp_path = tmp_path_factory.mktemp("chat")
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
    assert config.model.document_positions  # each packed conversation's positions from 0
    return tmp_path, train_lm(config)


@pytest.mark.slow
def test_chat_sft_trains_and_evaluates_the_assistant_loss(chat_run, repo_root, capsys, monkeypatch):
    tmp_path, result = chat_run
    assert result.final.step == 12
    (first, start), (last, end) = result.evals[0], result.evals[-1]
    assert (first, last) == (0, 12)
    assert end["eval/loss"] < 0.8 * start["eval/loss"]  # the held-out assistant tokens' loss
    assert "eval/perplexity" in end and "eval/bpb" not in end  # no bytes over masked tokens
    # the same, named for SFT; the share of the conversations' tokens trained
    assert end["eval/sft/assistant_loss"] == pytest.approx(end["eval/loss"], rel=1e-6)
    assert 0.1 < end["eval/sft/trained_fraction"] < 0.9
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert any("sft/assistant_loss" in m for m in logged)
    # `loomax generate --chat` renders the conversation with the run's template
    monkeypatch.chdir(repo_root)
    capsys.readouterr()  # the run's own output
    greedy = ["--temperature", "0", "--max_new_tokens", "3", "--no_stop"]
    checkpoint = str(tmp_path / "run" / "checkpoints")
    main(["generate", "--checkpoint", checkpoint, "--chat", json.dumps(QUESTION), *greedy])
    assert capsys.readouterr().out.startswith("<user>\nAdd 2 and 3.\n<assistant>\n")
    # `loomax eval` on the chat run's checkpoint: the held-out assistant loss of the last eval
    main(["eval", "--checkpoint", checkpoint, "--json"])
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["eval/loss"] == pytest.approx(end["eval/loss"], rel=1e-4)
    assert "eval/bpb" not in results


@pytest.mark.slow
def test_exported_sft_model_answers_as_loomax_generate_in_transformers(
    chat_run, repo_root, capsys, monkeypatch
):
    """`loomax export` writes the run's chat template into tokenizer_config.json; transformers'
    `apply_chat_template` + greedy `generate` on the export gives the tokens `loomax generate
    --chat` gives (12 new tokens, no stop)."""
    import jax

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from loomax.data.chat.encode import load_template, prompt_ids
    from loomax.data.tokenizer import load_tokenizer
    from loomax.inference import load_for_inference
    from loomax.models.decoding.generate import sample_tokens

    tmp_path, _ = chat_run
    monkeypatch.chdir(repo_root)
    checkpoint, out = str(tmp_path / "run" / "checkpoints"), tmp_path / "hf"
    main(["export", "--checkpoint", checkpoint, "--out", str(out)])
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())

    fast = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as --no_stop: the same number of tokens
    hf.generation_config.pad_token_id = fast.eos_token_id
    prompt = fast.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, top_k=None
        )[0].tolist()

    # loomax generate's own steps, for the ids; then the command, for its printed answer
    loaded = load_for_inference(checkpoint)
    tokenizer = load_tokenizer(loaded.tokenizer)
    template = load_template(loaded.run_config.data.chat.template, tokenizer, loaded.tokenizer)
    ours_prompt = prompt_ids(QUESTION, template, tokenizer)
    assert ours_prompt == prompt
    ours = sample_tokens(
        loaded.model, ours_prompt, seq_len=128, max_new_tokens=NEW_TOKENS, temperature=0.0,
        key=jax.random.PRNGKey(0), stop_token=None,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert len(set(theirs[len(prompt) :])) > 1  # an answer, not one token repeated
    capsys.readouterr()
    greedy = ["--temperature", "0", "--max_new_tokens", str(NEW_TOKENS), "--no_stop"]
    main(["generate", "--checkpoint", checkpoint, "--chat", json.dumps(QUESTION), *greedy])
    assert capsys.readouterr().out.strip() == tokenizer.decode(theirs).strip()
