"""The Gated DeltaNet layer (``models/blocks/gated_deltanet.py``): decoding a position at a
time with its cache (conv inputs + the rule's state) gives the training forward's outputs;
packed documents never see each other (the convolution included); the cache's bytes are the
same at every position, against a full-attention KV cache that grows with it."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from loomax.models.blocks.gated_deltanet import GatedDeltaNet, cache_bytes

B, T, D = 2, 20, 16


@eqx.filter_jit  # one program (op by op, the init compiled each random draw on its own)
def layer(chunk=8):
    return GatedDeltaNet.init(D, key_heads=2, value_heads=4, dk=8, dv=6, conv_kernel=4,
                              chunk=chunk, key=jax.random.PRNGKey(0))  # fmt: skip


def test_decoding_a_position_at_a_time_gives_the_training_outputs():
    with jax.enable_x64(True):
        net = jax.tree.map(lambda a: a.astype(jnp.float64), layer())
        x = jax.random.normal(jax.random.PRNGKey(1), (B, T, D), jnp.float64)
        want = jax.jit(lambda n, x: n(x))(net, x)
        step = jax.jit(lambda x, c: GatedDeltaNet.decode(net, x, c))
        cache, outs = net.init_cache(B, jnp.float64), []
        for t in range(T):
            out, cache = step(x[:, t : t + 1], cache)
            outs.append(out)
        np.testing.assert_allclose(jnp.concatenate(outs, 1), want, atol=1e-10, rtol=0)
        assert float(jnp.max(jnp.abs(want))) > 0.1


def test_packed_documents_never_see_each_other():
    net, x = layer(), jax.random.normal(jax.random.PRNGKey(1), (1, T, D))
    seg = jnp.asarray([[0] * 7 + [1] * 13])

    @jax.jit  # the four forwards as one program (op by op: ~200 small compiles)
    def forwards(net, x, seg):
        return net(x, seg), net(x[:, 7:]), net(x.at[:, :7].add(3.0), seg), net(x)

    packed, alone, other, unpacked = forwards(net, x, seg)
    np.testing.assert_allclose(packed[:, 7:], alone, atol=1e-5)
    np.testing.assert_array_equal(other[:, 7:], packed[:, 7:])
    assert not np.allclose(unpacked[:, 7:10], packed[:, 7:10], atol=1e-3)  # without: it leaks


def test_the_cache_is_the_same_size_at_every_position():
    """Its bytes after 1 and after 20 positions are equal (the conv inputs and the state);
    a full-attention layer of the same width (keys and values of width 16) adds 2 x 16
    values a position, so its cache passes this one's after 11.25 positions."""
    net = layer()
    cache = net.init_cache(B)
    step = jax.jit(lambda x, c: GatedDeltaNet.decode(net, x, c))
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, D))
    sizes = []
    for t in range(T):
        _, cache = step(x[:, t : t + 1], cache)
        sizes.append(cache_bytes(cache))
    assert len(set(sizes)) == 1
    per_row = sizes[0] // B  # 3 conv inputs of 2 x 2 x 8 + 4 x 6 channels, a 4 x 8 x 6 state
    assert per_row == 4 * (3 * 56 + 4 * 8 * 6) == 1440
    kv_per_position = 4 * 2 * D  # float32 keys and values of the layer's width
    assert per_row / kv_per_position == 11.25


def test_the_layer_is_transformers_qwen3_next_gated_deltanet():
    """transformers' ``Qwen3NextGatedDeltaNet`` (its torch fallback) with random weights, put
    into this layer: the same outputs (float32, 1e-5)."""
    import torch
    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_module

    config = transformers.Qwen3NextConfig(
        hidden_size=D, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
        layer_types=["linear_attention"], rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = hf_module.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    w = {n: jnp.asarray(p.detach().numpy()) for n, p in hf.named_parameters()}
    net = GatedDeltaNet(
        w["in_proj_qkvz.weight"].T, w["in_proj_ba.weight"].T, w["conv1d.weight"][:, 0].T,
        w["dt_bias"], w["A_log"], w["norm.weight"], w["out_proj.weight"].T,
        key_heads=2, value_heads=4, dk=8, dv=6, chunk=8, eps=1e-6,
    )  # fmt: skip
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (B, T, D)))
    with torch.no_grad():
        want = hf(torch.tensor(x)).numpy()
    got = jax.jit(lambda net, x: net(x))(net, jnp.asarray(x))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
