"""Qwen3-Next (``model.type: qwen3_next``): a model transformers built (random weights, a
linear and a full layer) imports with its logits (f32, 1e-5) and greedy tokens (our
hybrid cache: KV for the full layer, conv + recurrent state for the linear one); our
model, trained a few steps, exports to transformers with the same logits and tokens; packed
documents stay apart; batched decoding; context parallelism and options the model lacks are
refused."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.hf import export_hf, load_hf
from loomax.models import LmConfig
from loomax.models.decoding.generate import sample_tokens
from loomax.models.moe.moe import MoeConfig

VOCAB = 37
KEY = jax.random.PRNGKey(0)
IDS = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (16,), 0, VOCAB))
PROMPT = [3, 1, 4, 1, 5]
Qwen3Next = LmConfig.get_choice_class("qwen3_next")
TINY = Qwen3Next(
    seq_len=16, hidden_dim=16, num_layers=2, layer_types=("linear_attention", "full_attention"),
    num_heads=4, num_kv_heads=2, head_dim=8, linear_key_heads=2, linear_value_heads=4,
    linear_key_dim=8, linear_value_dim=8, linear_chunk=4, expert_dim=16, shared_expert_dim=24,
    moe=MoeConfig(num_experts=4, num_experts_per_tok=2),
)  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, families):
    import transformers

    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=16,
    )  # fmt: skip
    hf = families.noisy_hf_model(config, 0.5)
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(path)
    return path, hf


def test_a_model_transformers_built_imports_with_its_logits_and_greedy_tokens(hf_dir, families):

    path, hf = hf_dir
    loaded = load_hf(path)
    assert loaded.config.layer_kinds == ("linear_attention", "full_attention")
    assert loaded.config.rotary_dim == 2  # partial rotary: a quarter of 8
    np.testing.assert_allclose(
        families.jit_logits(loaded, IDS), families.hf_logits(hf, IDS), rtol=1e-5, atol=1e-5
    )
    ours = sample_tokens(loaded, PROMPT, seq_len=16, max_new_tokens=8, temperature=0.0, key=KEY)
    assert ours == families.hf_greedy(hf, PROMPT, 8)


def test_trained_export_gives_transformers_logits_and_greedy_tokens(tmp_path, families):
    """Trained 12 Adam steps on a repeating sequence, exported: transformers' logits (f32,
    1e-5) and greedy tokens; the config.json comes back as the config."""
    import torch
    import transformers

    model = families.trained(TINY, VOCAB, KEY)
    export_hf(model, tmp_path, special_tokens={"eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    np.testing.assert_allclose(
        families.jit_logits(model, IDS), families.hf_logits(hf, IDS), rtol=1e-5, atol=1e-5
    )
    ours = sample_tokens(model, PROMPT, seq_len=16, max_new_tokens=8, temperature=0.0, key=KEY)
    assert ours[5:7] == [9, 2]  # it learned the sequence
    assert ours == families.hf_greedy(hf, PROMPT, 8)
    assert load_hf(tmp_path).config.hf_config(VOCAB) == TINY.hf_config(VOCAB)


@pytest.fixture(scope="module")
def noisy():
    """TINY with every weight moved off its initial value (shared: one eager build)."""
    model = TINY.build(VOCAB, key=KEY)
    return jax.tree.map(lambda x: x + 0.1 * jax.random.normal(KEY, x.shape), model)


@eqx.filter_jit
def hidden(model, ids, segment_ids=None):
    """The training forward's hidden states, as one compiled program (op by op, the DeltaNet's
    chunked scan compiles hundreds of small ones)."""
    return model.hidden_states(hax.named(ids, "position"), segment_ids=segment_ids).array


def test_decoding_equals_the_training_forward(noisy):
    model = noisy
    cache = model.init_cache((), 16, np.float32)
    decode = eqx.filter_jit(lambda m, ids, cache, t: m.decode(hax.named(ids, "position"), cache, t))
    # the position traced, as generation passes it: one compile for the prefill, one a token
    first, cache = decode(model, IDS[:10], cache, jnp.asarray(0, jnp.int32))
    rest = []
    for t in range(10, 16):
        h, cache = decode(model, IDS[t : t + 1], cache, jnp.asarray(t, jnp.int32))
        rest.append(h.array)
    got = np.concatenate([first.array, *rest])
    want = hidden(model, IDS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_context_parallelism_is_refused_naming_the_key():
    from loomax.lm.config import TrainLmConfig
    from loomax.mesh import MeshConfig
    from loomax.train.config import TrainerConfig

    trainer = TrainerConfig(mesh=MeshConfig(context=2))
    with pytest.raises(ConfigError, match="model.layer_types.*trainer.mesh.context"):
        TrainLmConfig(model=TINY, trainer=trainer)


def test_packed_documents_never_see_each_other(noisy):
    """The second of two packed documents computes as it would alone (rotary is relative;
    the DeltaNet's state and convolution restart at the boundary)."""
    seg = hax.named(np.repeat([0, 1], [6, 10]), "position")
    packed = hidden(noisy, IDS, seg)
    alone = hidden(noisy, IDS[6:])
    np.testing.assert_allclose(packed[6:], alone, rtol=1e-5, atol=1e-5)
    mixed = hidden(noisy, IDS)
    assert not np.allclose(mixed[6:], alone, atol=1e-3)


@pytest.mark.parametrize("key,value", [("fp8", "emulate"), ("resid_pdrop", 0.1)])
def test_options_the_model_lacks_are_refused_naming_the_key(key, value):
    import dataclasses

    with pytest.raises(ConfigError, match=f"model.{key}"):
        dataclasses.replace(TINY, **{key: value})


def test_batched_decoding_gives_each_prompt_its_own_greedy_tokens(hf_dir):
    """Prompts of unequal lengths (padding would enter the DeltaNet state) and of equal ones."""
    from loomax.models.decoding.generate import sample_batch

    model = load_hf(hf_dir[0])
    prompts = [PROMPT, PROMPT[:3], [2, 7, 1, 8, 2]]
    alone = [
        sample_tokens(model, p, seq_len=16, max_new_tokens=4, temperature=0.0, key=KEY)
        for p in prompts
    ]
    keys = jax.random.split(KEY, 3)
    got = sample_batch(model, prompts, seq_len=16, max_new_tokens=4, keys=keys, temperature=0.0)
    assert got == alone
    same = [prompts[0], prompts[2]]
    got = sample_batch(model, same, seq_len=16, max_new_tokens=4, keys=keys[:2], temperature=0.0)
    assert got == [alone[0], alone[2]]


def test_parameters_name_their_hidden_and_expert_axes_for_the_mesh():
    """FSDP splits ``embed`` and expert parallelism ``experts``: every matrix names one."""
    shapes = jax.eval_shape(lambda: TINY.build(VOCAB, key=KEY))
    for name, p in shapes.params.items():
        names = [a.name for a in p.axes]
        if len(names) >= 2 and "conv1d" not in name:
            assert "embed" in names, name
        assert ("experts" in names) == (".mlp.experts." in name), name


def test_each_layer_is_rematerialised_under_the_remat_policy(noisy):
    """``gradient_checkpointing`` true (the default) or recompute: each layer's forward is
    checkpointed (recomputed in the backward pass), false: none; the gradients agree."""
    import dataclasses

    ids = hax.named(IDS, "position")
    loss = lambda m: jnp.sum(m.hidden_states(ids).array ** 2)  # noqa: E731

    def traced(policy, float64: bool = False):
        """``jit(grad(loss))`` of the shared weights under ``policy`` (in float64 if asked),
        traced once: its count of checkpointed regions, and the trace to compile."""
        config = dataclasses.replace(TINY, gradient_checkpointing=policy)
        skeleton = jax.tree.structure(jax.eval_shape(lambda: config.build(VOCAB, key=KEY)))
        cast = (lambda x: x.astype(jnp.float64)) if float64 else (lambda x: x)
        model = jax.tree.unflatten(skeleton, [cast(x) for x in jax.tree.leaves(noisy)])
        trace = jax.jit(jax.grad(loss)).trace(model)
        eqns = trace.jaxpr.eqns
        remats = sum("remat" in e.primitive.name or "checkpoint" in e.primitive.name for e in eqns)
        return remats, trace, model

    assert traced("recompute")[0] == TINY.num_layers
    with jax.enable_x64(True):  # float64: f32's rounding, fused otherwise, moves small terms
        (on, on_trace, on_model), (off, off_trace, off_model) = (
            traced(True, True),
            traced(False, True),
        )
        assert {x.dtype for x in jax.tree.leaves(on_model)} == {jnp.dtype(jnp.float64)}
        with_remat = jax.tree.leaves(on_trace.lower().compile()(on_model))
        without = jax.tree.leaves(off_trace.lower().compile()(off_model))
    assert (on, off) == (TINY.num_layers, 0)
    for a, b in zip(with_remat, without, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        dataclasses.replace(TINY, gradient_checkpointing="nested")
