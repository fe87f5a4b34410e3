"""The ``data.chat`` section: how conversations become training rows (``data.format: chat``)."""

from dataclasses import dataclass

LOSS_ON = ("assistant", "last_assistant", "all")
PACKING = ("first_fit", "best_fit", "none")


@dataclass(frozen=True)
class ChatConfig:
    """Chat SFT data: conversations (a `messages` list of {role, content}) rendered by a chat template."""

    template: str | None = None
    """A shipped template by name (loomax | chatml), a .jinja file, or a tokenizer_config.json holding `chat_template`; null = the tokenizer folder's tokenizer_config.json if it has one, else `loomax`."""

    messages_key: str = "messages"
    """Key of each .jsonl record's list of turns (the column of a .parquet file)."""

    loss_on: str = "assistant"
    """Which tokens the loss covers: assistant (every assistant turn) | last_assistant (the last one) | all (every token)."""

    packing: str = "first_fit"
    """How conversations fill rows of `model.seq_len`: first_fit | best_fit (both deterministic, in file order) | none (one conversation per row, padded)."""

    drop_overlong: bool = False
    """Drop (and count) conversations longer than `model.seq_len` instead of stopping with an error naming the file and line."""

    def __post_init__(self) -> None:
        if self.loss_on not in LOSS_ON:
            raise ValueError(
                f"data.chat.loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}"
            )
        if self.packing not in PACKING:
            raise ValueError(
                f"data.chat.packing must be one of {', '.join(PACKING)}, got {self.packing!r}"
            )
        if not self.messages_key:
            raise ValueError("data.chat.messages_key must not be empty")
