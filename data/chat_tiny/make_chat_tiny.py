"""Make the shipped tiny chat set: conversations whose assistant turns follow one checkable
format, and a byte-level BPE trained on them rendered with the `loomax` template.

    python data/chat_tiny/make_chat_tiny.py     # rewrites train.jsonl and tokenizer.json here

The user asks for one of three operations (add two numbers, reverse a word, spell a word in
capitals); the assistant always answers `<op>(<input>) = <result>` on one line. The answer is
a pure function of the question, so a model that learned the format and the operations gets
the assistant tokens right; `check_answer` checks one. Seeded: the same files every time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "apple river stone cloud maple tiger lemon orbit piano candle forest rocket silver "
    "garden pencil window summer planet bridge violet dragon copper island meadow"
).split()
SYSTEMS = ("", "You answer in the exact format.", "Be brief.")


def exchange(rng: random.Random) -> tuple[str, str]:
    """One question and its answer."""
    op = rng.choice(("add", "reverse", "upper"))
    if op == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        question = rng.choice(("What is {a} plus {b}?", "Add {a} and {b}.", "{a} + {b} = ?"))
        return question.format(a=a, b=b), f"add({a}, {b}) = {a + b}"
    word = rng.choice(WORDS)
    if op == "reverse":
        question = rng.choice(("Reverse the word {w}.", "Spell {w} backwards."))
        return question.format(w=word), f"reverse({word}) = {word[::-1]}"
    question = rng.choice(("Write {w} in capitals.", "Shout {w}."))
    return question.format(w=word), f"upper({word}) = {word.upper()}"


def conversation(rng: random.Random) -> list[dict]:
    """A system turn (sometimes), then one to three question-answer exchanges."""
    messages = []
    system = rng.choice(SYSTEMS)
    if system:
        messages.append({"role": "system", "content": system})
    for _ in range(rng.randint(1, 3)):
        question, answer = exchange(rng)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    return messages


def check_answer(question: str, answer: str) -> bool:
    """Whether ``answer`` is the right answer, in the format, to ``question``."""
    rng_free = [t.strip(".?") for t in question.split()]
    numbers = [int(t) for t in rng_free if t.isdigit()]
    words = [t for t in rng_free if t in WORDS]
    if len(numbers) == 2:
        a, b = numbers
        return answer == f"add({a}, {b}) = {a + b}"
    if words and ("Reverse" in question or "backwards" in question):
        return answer == f"reverse({words[0]}) = {words[0][::-1]}"
    return bool(words) and answer == f"upper({words[0]}) = {words[0].upper()}"


def main(count: int = 1500, vocab_size: int = 512) -> None:
    here = Path(__file__).parent
    rng = random.Random(0)
    conversations = [conversation(rng) for _ in range(count)]
    with open(here / "train.jsonl", "w") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": messages}) + "\n")
    from loomax.data.chat.render import render
    from loomax.data.chat.templates import LOOMAX
    from loomax.data.tokenizer import EOS_TOKEN, train_bpe_tokenizer

    special = {"bos_token": "", "eos_token": EOS_TOKEN}
    texts = [render(LOOMAX, m, special) for m in conversations]
    train_bpe_tokenizer(texts, vocab_size, here / "tokenizer.json")


if __name__ == "__main__":
    main()
