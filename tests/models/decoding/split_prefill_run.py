"""Worker for the split-prefill tests (8 fake CPU devices, a fresh process): prints JSON.

A tiny grouped-query Llama; a 37-token prompt in a 64-position cache, prefilled whole on
one device and split over data 2 x context 4 with each ``model.context_parallel`` variant;
then greedy generation from each (a 60-position buffer: rounded up to 64 when split), and
from a tiny GPT-2 and Mixtral; and bench/split_prefill.py at 256 positions (its ``main``,
in this process).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
from bench_main import bench_rows  # noqa: E402

from loomax.config import ConfigError  # noqa: E402
from loomax.mesh import MeshConfig, make_axis_mappings  # noqa: E402
from loomax.models import Gpt2Config, LlamaConfig  # noqa: E402
from loomax.models.attention.sequence_layout import from_layout  # noqa: E402
from loomax.models.axes import KeyPosition, Position  # noqa: E402
from loomax.models.decoding.generate import _cached_steps, _split_steps, sample_tokens  # noqa: E402
from loomax.models.decoding.split_prefill import on_mesh, split_prefill  # noqa: E402
from loomax.models.families.mistral import MistralConfig  # noqa: E402
from loomax.models.families.mixtral import MixtralConfig  # noqa: E402
from loomax.models.moe.moe import MoeConfig  # noqa: E402
from loomax.runtime import MeshRuntime  # noqa: E402

CACHE, PROMPT, VOCAB, BUFFER, NEW = 64, 37, 64, 60, 8


@functools.cache  # the ring Llama twice: its variant's run and the trainer-weights one
def tiny_llama(variant: str):
    config = LlamaConfig(
        seq_len=CACHE, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=2, context_parallel=variant, flash_attention_block_size=4,
    )  # fmt: skip
    return sharpened(config)


def sharpened(config):
    """A random model with large weights, so greedy paths branch on real logit gaps (built
    and scaled in one compiled program, not an eager op compiled per weight shape)."""

    @eqx.filter_jit
    def build(key):
        model = config.build(VOCAB, key=key)
        return jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, model)

    return build(jax.random.PRNGKey(0))


def logits_of(model, hidden):
    return hax.dot(hidden, model.lm_head_weight(), axis="embed").array


def unsplit(model, tokens):
    """Logits and cache of the whole buffer prefilled on one device (``model.decode`` from 0)."""

    @jax.jit
    def run(model, tokens):
        cache = model.init_cache((), CACHE, jnp.float32)
        hidden, cache = model.decode(hax.named(tokens, Position), cache, jnp.asarray(0))
        return logits_of(model, hidden), cache

    return run(model, tokens)


@jax.jit
def _split_run(model, tokens):
    hidden, cache = split_prefill(model, hax.named(tokens, Position))
    return logits_of(model, from_layout(hidden)), cache


def split(model, tokens, runtime):
    """Logits (put back in the tokens' order) and cache of the split prefill (one jitted
    function: the prompt and the prompt with garbage padding share its program; every call
    is under the one mesh of ``main``)."""
    with runtime.mesh_context():
        logits, cache = _split_run(on_mesh(model, runtime.mesh), tokens)
    return logits, cache


def max_error(a, b) -> float:
    """Largest difference of ``a`` from ``b``, relative to ``b``'s largest entry."""
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def decode_step_collectives(hlo: str) -> dict:
    """All-gathers and all-reduces in the compiled greedy decode step on the split cache."""
    return {op: hlo.count(f" {op}(") for op in ("all-gather", "all-reduce")}


def main() -> dict:
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, VOCAB, PROMPT).tolist()
    tokens = jnp.asarray(np.pad(prompt, (0, CACHE - PROMPT)), jnp.int32)
    runtime = MeshRuntime(MeshConfig(data=2, context=4).build(), make_axis_mappings())
    result = {}
    for variant in ("ring", "all_gather"):
        model = tiny_llama(variant)
        ref_logits, ref_cache = unsplit(model, tokens)
        logits, cache = split(model, tokens, runtime)
        greedy = dict(seq_len=BUFFER, max_new_tokens=NEW, temperature=0.0, key=jax.random.PRNGKey(1))  # fmt: skip
        one = sample_tokens(model, prompt, **greedy)
        many, used = split_calls(model, prompt, mesh=runtime.mesh, **greedy)
        state = _split_state(model, runtime, prompt)
        garbage = np.random.default_rng(2).integers(1, VOCAB, CACHE - PROMPT)
        noisy = jnp.asarray(np.concatenate([prompt, garbage]), jnp.int32)
        noisy_logits, noisy_cache = split(model, noisy, runtime)
        step_args = (on_mesh(model, runtime.mesh), state, jnp.asarray(PROMPT), greedy["key"])
        step = _cached_steps(0.0, None, None, None).next.lower(*step_args).compile()  # run, read
        stepped, _ = step(*step_args)
        result[variant] = {
            "logits_error": max_error(logits[:PROMPT], ref_logits[:PROMPT]),
            "k_error": max_error(cache.k.array, ref_cache.k.array),
            "v_error": max_error(cache.v.array, ref_cache.v.array),
            "cache_position_spec": _position_spec(cache.k),
            "stepped_cache_position_spec": _position_spec(stepped[0].k),
            "unsplit_tokens": one,
            "split_tokens": many,
            "split_prefills": used,
            "garbage_pad_logits_diff": max_error(noisy_logits[:PROMPT], logits[:PROMPT]),
            "garbage_pad_tokens": greedy_from(model, runtime, noisy[:BUFFER], prompt),
            "decode_collectives": decode_step_collectives(step.as_text()),
        }
    # the ring Llama's weights laid out as a trainer's (FSDP over data): split unasked
    model = tiny_llama("ring")
    sharded = jax.device_put(model, runtime.state_shardings(model))
    result["trainer_weights"] = {"unsplit_tokens": result["ring"]["unsplit_tokens"]}
    result["trainer_weights"]["split_tokens"], result["trainer_weights"]["split_prefills"] = (
        split_calls(sharded, prompt, **greedy)
    )
    gpt2 = sharpened(Gpt2Config(seq_len=BUFFER, hidden_dim=32, num_layers=2, num_heads=4))
    greedy = dict(seq_len=BUFFER, max_new_tokens=NEW, temperature=0.0, key=jax.random.PRNGKey(1))
    result["gpt2"] = {
        "unsplit_tokens": sample_tokens(gpt2, prompt, **greedy),
    }  # weights on a mesh with context 4: split without being asked
    on = on_mesh(gpt2, runtime.mesh)
    result["gpt2"]["split_tokens"], result["gpt2"]["split_prefills"] = split_calls(
        on, prompt, **greedy
    )
    moe = MoeConfig(num_experts=4, num_experts_per_tok=2)
    mixtral = sharpened(MixtralConfig(
        seq_len=CACHE, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=2, moe=moe,
    ))  # fmt: skip
    result["mixtral"] = {"unsplit_tokens": sample_tokens(mixtral, prompt, **greedy)}
    result["mixtral"]["split_tokens"], result["mixtral"]["split_prefills"] = split_calls(
        mixtral, prompt, mesh=runtime.mesh, **greedy
    )
    window = MistralConfig(seq_len=CACHE, hidden_dim=32, intermediate_dim=64, num_layers=1,
                           num_heads=4, num_kv_heads=2, sliding_window=8)  # fmt: skip
    try:
        sample_tokens(window.build(VOCAB, key=jax.random.PRNGKey(0)), prompt, mesh=runtime.mesh,
                      **greedy)  # fmt: skip
        result["window_error"] = None
    except ConfigError as error:
        result["window_error"] = str(error)
    return result


def greedy_from(model, runtime, buffer, prompt) -> list[int]:
    """``NEW`` greedy tokens after ``prompt`` from the split prefill of ``buffer`` (the prompt,
    then what the padding holds)."""
    model, out = on_mesh(model, runtime.mesh), list(prompt)
    steps = _split_steps(runtime.mesh, 0.0, None, None, None)
    with hax.axis_mapping({}):
        state = steps.start(model, buffer, len(prompt))
        for pos in range(len(prompt), len(prompt) + NEW):
            state, token = steps.next(model, state, jnp.asarray(pos), jax.random.PRNGKey(0))
            out.append(int(token))
    return out


def split_calls(model, prompt, **options):
    """``sample_tokens`` and how many times it fetched the split steps (``_split_steps``)."""
    before = _split_steps.cache_info()
    out = sample_tokens(model, prompt, **options)
    after = _split_steps.cache_info()
    return out, after.hits + after.misses - before.hits - before.misses


def _position_spec(x) -> str:
    """The mesh axes the ``key_position`` axis of cache array ``x`` is split over."""
    dim, spec = x.axes.index(x.resolve_axis(KeyPosition)), x.array.sharding.spec
    return str(spec[dim] if len(spec) > dim else None)


def _split_state(model, runtime, prompt):
    buffer = jnp.asarray(np.pad(prompt, (0, BUFFER - PROMPT)), jnp.int32)
    with hax.axis_mapping({}):
        steps = _split_steps(runtime.mesh, 0.0, None, None, None)
        return steps.start(on_mesh(model, runtime.mesh), buffer, PROMPT)


def bench() -> dict:
    """bench/split_prefill.py's rows at 256 positions (one layer of width 64, one decode step
    timed; its 16,384-position figures are in bench/README.md), run by its ``main`` in this
    process (8 fake devices, as its own), not a second one that imports JAX again."""
    args = ["--seq", "256", "--hidden", "64", "--layers", "1", "--steps", "1"]
    return bench_rows("split_prefill.py", args)


if __name__ == "__main__":
    print(json.dumps({**main(), "bench": bench()}))
