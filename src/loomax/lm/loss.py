"""The language-model objective the trainer minimises: next-token cross-entropy on token arrays."""

from __future__ import annotations

import haliax as hax
import jax.numpy as jnp

from loomax.lm.config import TrainLmConfig
from loomax.models.attention.attention import segment_ids_from_eos
from loomax.models.axes import Batch, Position
from loomax.models.config import LmConfig
from loomax.models.loss import next_token_loss_and_metrics


def lm_loss(
    block_size: int | None = 4096,
    *,
    z_loss_weight: float = 0.0,
    eos_id: int | None = None,
    vocab_block_size: int | None = None,
    vocab_multiple: int = 1,
    aux_losses: bool = True,
):
    """The trainer's loss: next-token cross-entropy on a ``[batch, position]`` token array,
    returned as ``((sum, tokens), metrics)`` with the model's metrics (``moe/...`` of an MoE
    model; none for a dense one).

    With ``eos_id``, attention stays within the documents packed into each sequence. The
    step's ``key`` reaches the model (its dropout); evaluation passes none. ``aux_losses``
    adds the model's own loss terms (MoE balance losses) to the sum.
    """

    def loss_fn(model, tokens, *, key=None):
        tokens = hax.auto_sharded(
            hax.named(tokens, (Batch, Position))
        )  # batch over (replica, data)
        segments = None if eos_id is None else segment_ids_from_eos(tokens, eos_id)
        return next_token_loss_and_metrics(
            model,
            tokens,
            block_size=block_size,
            z_loss_weight=z_loss_weight,
            segment_ids=segments,
            vocab_block_size=vocab_block_size,
            vocab_multiple=vocab_multiple,
            key=key,
            aux_losses=aux_losses,
        )

    return loss_fn


def chat_lm_loss(
    block_size: int | None = 4096,
    *,
    z_loss_weight: float = 0.0,
    vocab_block_size: int | None = None,
    vocab_multiple: int = 1,
    aux_losses: bool = True,
):
    """The chat SFT loss: ``lm_loss`` on packed chat rows, ``[batch, 3, position]`` int32
    (tokens, loss weights, document ids: ``loomax.data.chat.packing``). Only the predictions
    the weights mark count, and the mean divides by their number; attention stays within
    each packed conversation. Its metrics, under ``sft/`` (``eval/sft/...`` on held-out
    rows): ``assistant_loss``, the loss over the trained tokens (``data.chat.loss_on``: the
    assistant turns by default), and ``trained_fraction``, the share of the conversations'
    tokens that the loss trains."""

    def loss_fn(model, batch, *, key=None):
        def named(channel):
            return hax.auto_sharded(hax.named(batch[:, channel], (Batch, Position)))

        (total, count), metrics = next_token_loss_and_metrics(
            model,
            named(0),
            block_size=block_size,
            z_loss_weight=z_loss_weight,
            segment_ids=named(2),
            vocab_block_size=vocab_block_size,
            vocab_multiple=vocab_multiple,
            key=key,
            aux_losses=aux_losses,
            loss_weights=named(1),
        )
        tokens = jnp.sum(batch[:, 2] >= 0).astype(jnp.float32)
        sft = {"sft/assistant_loss": (total, count), "sft/trained_fraction": (count, tokens)}
        return (total, count), {**metrics, **sft}

    return loss_fn


def lm_loss_for(
    model: LmConfig,
    *,
    eos_id: int | None = None,
    z_loss_weight: float | None = None,
    aux_losses: bool = True,
    chat: bool = False,
):
    """``lm_loss`` with ``model``'s cross-entropy settings (blocks, vocabulary padding, and its
    z-loss unless ``z_loss_weight`` is given), attention kept within documents at ``eos_id``;
    ``chat_lm_loss`` for packed chat rows when ``chat``."""
    if chat:
        return chat_lm_loss(
            model.cross_entropy_block_size,
            z_loss_weight=model.z_loss_weight if z_loss_weight is None else z_loss_weight,
            vocab_block_size=model.cross_entropy_vocab_block_size,
            vocab_multiple=model.cross_entropy_vocab_multiple,
            aux_losses=aux_losses,
        )
    return lm_loss(
        model.cross_entropy_block_size,
        z_loss_weight=model.z_loss_weight if z_loss_weight is None else z_loss_weight,
        eos_id=eos_id,
        vocab_block_size=model.cross_entropy_vocab_block_size,
        vocab_multiple=model.cross_entropy_vocab_multiple,
        aux_losses=aux_losses,
    )


def model_lm_loss(config: TrainLmConfig, *, training: bool = True):
    """``lm_loss`` as ``config.model`` asks (block size, document masking with the tokenizer's EOS,
    and z-loss and the model's auxiliary losses when ``training``: evaluation reports the
    plain cross-entropy)."""
    model = config.model
    eos = None
    chat = config.data.format == "chat"
    if model.document_mask and not chat:
        from loomax.data.run_tokenizer import prepare_tokenizer
        from loomax.data.tokenizer import eos_id, load_tokenizer

        eos = eos_id(load_tokenizer(prepare_tokenizer(config.data)))
    return lm_loss_for(
        model,
        eos_id=eos,
        z_loss_weight=None if training else 0.0,
        aux_losses=training,
        chat=chat,
    )
