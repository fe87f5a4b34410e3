"""Greedy answers of a chat SFT checkpoint on held-out questions of the shipped tiny chat set.

    python bench/sft_answers.py runs/<id>/checkpoints [N]

Renders N held-out one-question conversations (the run's held-out split of
data/chat_tiny/train.jsonl, first question each) with the run's chat template, decodes
greedily to EOS, and counts answers in the format `op(input) = result` and answers that are
right (data/chat_tiny/make_chat_tiny.py's `check_answer`).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import jax

from loomax.data.chat.dataset import held_out, read_conversations
from loomax.data.chat.encode import load_template, prompt_ids
from loomax.data.tokenizer import eos_id, load_tokenizer
from loomax.inference import load_for_inference
from loomax.models.decoding.generate import sample_tokens

REPO = Path(__file__).resolve().parents[1]
FORMAT = re.compile(r"^(add|reverse|upper)\(.*\) = \S+$")


def main(checkpoint: str, count: int = 50) -> None:
    spec = importlib.util.spec_from_file_location("mk", REPO / "data/chat_tiny/make_chat_tiny.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    loaded = load_for_inference(checkpoint)
    data = loaded.run_config.data
    tokenizer = load_tokenizer(loaded.tokenizer)
    template = load_template(data.chat.template, tokenizer, loaded.tokenizer)
    stop = eos_id(tokenizer)
    records = read_conversations(data.train[0], data.chat.messages_key, "data.train[0]")
    held = [m for r, (_, m) in enumerate(records) if held_out(0, r, data.validation_fraction)]
    formatted = right = done = 0
    for messages in held[:count]:
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        question = messages[: first_user + 1]
        prompt = prompt_ids(question, template, tokenizer)
        out = sample_tokens(
            loaded.model, prompt, seq_len=loaded.model.config.seq_len, max_new_tokens=24,
            temperature=0.0, key=jax.random.PRNGKey(0), stop_token=stop,
        )  # fmt: skip
        answer = tokenizer.decode(out[len(prompt) :]).strip()
        formatted += bool(FORMAT.match(answer))
        right += maker.check_answer(question[-1]["content"], answer)
        done += 1
    print(f"{done} held-out questions: {formatted} in the format, {right} right")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
