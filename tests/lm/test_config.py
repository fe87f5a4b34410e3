"""``TrainLmConfig``'s own resolutions: positions per packed document for chat SFT."""

from __future__ import annotations

import dataclasses

import pytest

from loomax.config import ConfigError, parse_config
from loomax.lm import TrainLmConfig
from loomax.models import LlamaConfig


def test_chat_runs_restart_positions_per_conversation_and_text_runs_do_not(repo_root):
    chat = parse_config(TrainLmConfig, repo_root / "config" / "sft_tiny.yaml")
    assert chat.data.format == "chat" and chat.model.document_positions is True
    off = parse_config(
        TrainLmConfig,
        repo_root / "config" / "sft_tiny.yaml",
        ["--model.document_positions", "false"],
    )
    assert off.model.document_positions is False  # a run may still ask for running positions
    text = TrainLmConfig(model=LlamaConfig(document_mask=True))
    assert not text.model.document_positions  # pretraining's default is unchanged
    assert TrainLmConfig(model=LlamaConfig(document_mask=True, document_positions=True))


def test_document_positions_without_documents_is_refused():
    with pytest.raises(ConfigError, match="model.document_positions .* model.document_mask"):
        TrainLmConfig(model=LlamaConfig(document_positions=True))
    chat = TrainLmConfig(model=LlamaConfig())
    with pytest.raises(ConfigError, match="model.document_positions"):
        dataclasses.replace(chat, model=LlamaConfig(document_positions=True))
