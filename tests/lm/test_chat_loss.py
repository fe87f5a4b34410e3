"""Chat SFT's objective: packed and unpacked rows give the same per-token losses (for every
shipped template), and the loss mask's count is the mean's normaliser."""

from __future__ import annotations

import json

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.data.chat.encode import encode_chat, load_template
from loomax.data.chat.packing import SEGMENTS, TOKENS, WEIGHTS, assign_rows, pack_rows
from loomax.data.chat.templates import SHIPPED
from loomax.data.tokenizer import load_tokenizer
from loomax.lm.loss import chat_lm_loss
from loomax.models import LlamaConfig
from loomax.models.axes import Batch, Position, Vocab

SEQ = 256


@pytest.fixture(scope="module")
def setup(repo_root):
    folder = repo_root / "data" / "chat_tiny"
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    with open(folder / "train.jsonl") as f:
        chats = [json.loads(next(f))["messages"] for _ in range(10)]
    config = LlamaConfig(
        seq_len=SEQ, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2,
        num_kv_heads=1, cross_entropy_block_size=64,
    )  # fmt: skip
    model = config.build(tokenizer.get_vocab_size(), key=jax.random.PRNGKey(0))
    return folder, tokenizer, chats, model


def token_losses(model, rows: np.ndarray) -> np.ndarray:
    """Each position's next-token loss, from full logits (the reference)."""
    named = [hax.named(jnp.asarray(rows[:, c]), (Batch, Position)) for c in (TOKENS, SEGMENTS)]
    hidden, _ = model.hidden_states_and_aux(named[0], segment_ids=named[1])
    w = model.lm_head_weight().rearrange((Vocab, ...)).array
    logits = jnp.einsum("bpe,ve->bpv", hidden.rearrange((Batch, Position, ...)).array, w)
    targets = np.roll(rows[:, TOKENS], -1, axis=1)
    picked = jnp.take_along_axis(logits, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
    return np.asarray(jax.nn.logsumexp(logits, axis=-1) - picked)


@pytest.mark.slow
@pytest.mark.parametrize("template_name", sorted(SHIPPED))
def test_packed_and_unpacked_give_the_same_per_token_losses(setup, template_name):
    folder, tokenizer, chats, model = setup
    template = load_template(template_name, tokenizer, folder / "tokenizer.json")
    convs = [encode_chat(m, template, tokenizer) for m in chats]
    lengths = [len(ids) for ids, _ in convs]
    packed_rows = assign_rows(lengths, SEQ, "first_fit")
    assert len(packed_rows) < len(convs)  # conversations do share rows
    packed = pack_rows(convs, packed_rows, SEQ, pad_id=0)
    alone = pack_rows(convs, assign_rows(lengths, SEQ, "none"), SEQ, pad_id=0)
    lp, la = token_losses(model, packed), token_losses(model, alone)
    for r, members in enumerate(packed_rows):
        at = 0
        for i in members:
            n = lengths[i]
            np.testing.assert_array_equal(packed[r, WEIGHTS, at : at + n], alone[i, WEIGHTS, :n])
            w = alone[i, WEIGHTS, :n] > 0
            # equal to 1e-6 relative: only f32 rounding differs (rotary angles at other offsets)
            np.testing.assert_allclose(lp[r, at : at + n][w], la[i, :n][w], rtol=1e-6, atol=0)
            at += n
    # the trainer's fused loss: the same sum, over exactly the masked-in tokens
    loss = chat_lm_loss(64, vocab_multiple=128)
    (sp, cp), _ = loss(model, jnp.asarray(packed))
    (sa, ca), _ = loss(model, jnp.asarray(alone))
    assert (
        int(cp)
        == int(ca)
        == int(packed[:, WEIGHTS].sum())
        == sum(int(t[1:].sum()) for _, t in convs)
    )
    np.testing.assert_allclose(float(sp), float(sa), rtol=1e-6)
    np.testing.assert_allclose(float(sp), float((lp * packed[:, WEIGHTS]).sum()), rtol=1e-5)
