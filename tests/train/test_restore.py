"""A fresh state's init program (``loomax.train.restore.init_program``) on XLA:CPU.

The init compiles with ``CPU_INIT_COMPILER_OPTIONS`` (a cheaper LLVM pipeline, XLA's
elemental fusion emitters); its values must be bitwise those of XLA:CPU's default
compile, for every registered model family, or a run's start would depend on the options.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.extend.core as jcore
import numpy as np
import pytest

from loomax._jax_compat import installed_version
from loomax.config_reference import registry_members
from loomax.models import LmConfig
from loomax.train import restore

MODEL_TYPES = [name for name, _ in registry_members(LmConfig)]
"""Every built-in model type."""
DEFAULT_CPU_OPTIONS = {"xla_backend_optimization_level": 3}
"""XLA:CPU's defaults for what ``CPU_INIT_COMPILER_OPTIONS`` changes (the tests' own XLA flags
set other values, so the reference names them)."""
if installed_version("jaxlib") < (0, 11):
    DEFAULT_CPU_OPTIONS["xla_cpu_use_fusion_emitters"] = True
_KEY = jax.random.key(0)


def _layer_types(model) -> frozenset[str]:
    """The classes of the modules ``model`` is built of (its parameters' init code)."""
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, eqx.Module) and x is not model)
    found = {type(model).__qualname__}
    for leaf in leaves:
        if isinstance(leaf, eqx.Module):
            found |= _layer_types(leaf)
    return frozenset(found)


def _init_leaves(lowered, options) -> list[np.ndarray]:
    """The values of the init program ``lowered``, compiled with ``options``."""
    compiled = lowered.compile(compiler_options=options)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(compiled(jax.random.key(0)))]


def _computation(jaxpr, out) -> tuple:
    """What computes ``jaxpr``'s output ``out``, key handling left out: each equation it
    depends on (its primitive, and its outputs' dtypes and ranks; called jaxprs inside),
    not the shapes' sizes or the constants (an init's std)."""
    needed, eqns = {out}, []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            eqns.append(eqn)
            needed |= {v for v in eqn.invars if not isinstance(v, jcore.Literal)}
    return tuple(_equation(eqn) for eqn in reversed(eqns) if not _keys_only(eqn))


def _equation(eqn) -> tuple:
    inner = tuple(_computation(j, v) for j in jcore.jaxprs_in_params(eqn.params) for v in j.outvars)
    outs = tuple((str(v.aval.dtype), v.aval.ndim) for v in eqn.outvars)
    return (eqn.primitive.name, outs, inner)


def _keys_only(eqn) -> bool:
    """Whether ``eqn`` makes only PRNG keys (the splits that differ by a parameter's place)."""
    return all(jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.prng_key) for v in eqn.outvars)


def _distinct_inits(families, cases: list[str], vocab: int) -> list[tuple[str, jax.stages.Lowered]]:
    """For each model type of ``cases``, its init program reduced to the parameters whose
    init computation (``_computation``) no parameter before it (in ``cases`` order) has:
    every kind of init of every layer type, each once (XLA drops the others' draws)."""
    seen: set[tuple] = set()
    programs = []
    for model_type in cases:
        config = families.tiny_config(model_type)
        build = lambda key, c=config: jax.tree.leaves(c.build(vocab, key=key))  # noqa: E731
        jaxpr = jax.make_jaxpr(build)(_KEY)
        keep = []
        for i, out in enumerate(jaxpr.jaxpr.outvars):
            computation = _computation(jaxpr.jaxpr, out)
            if computation not in seen:
                seen.add(computation)
                keep.append(i)
        if keep:
            run = jcore.jaxpr_as_fun(jaxpr)
            program = jax.jit(lambda key, run=run, keep=tuple(keep): [run(key)[i] for i in keep])
            programs.append((model_type, program.lower(_KEY)))  # one program, compiled both ways
    return programs


def _covering_families(families, vocab: int) -> list[str]:
    """Model types whose models together hold every layer type of every family: each adds a
    layer type none before it holds (the largest sets of layer types first, then registry
    order). Whatever a family of new layers initialises is among them."""
    found: dict[str, frozenset[str]] = {}
    for model_type in MODEL_TYPES:
        config = families.tiny_config(model_type)
        shapes = eqx.filter_eval_shape(lambda k, c=config: c.build(vocab, key=k), _KEY)
        found[model_type] = _layer_types(shapes)
    chosen: list[str] = []
    covered: set[str] = set()
    for model_type in sorted(found, key=lambda t: -len(found[t])):  # stable: registry order
        if not found[model_type] <= covered:
            chosen.append(model_type)
            covered |= found[model_type]
    assert covered == set().union(*found.values())
    return chosen


@pytest.mark.slow
def test_the_cpu_init_options_give_the_default_compiles_values_bitwise(families, tiny):
    """Fresh parameters compiled with ``CPU_INIT_COMPILER_OPTIONS`` equal the default
    compile's bitwise, for families that together hold every layer type (a family of new
    layers is a case of its own; the others initialise the same layers at other shapes),
    each kind of init computation once: XLA's default compile of a whole family's init takes
    5-13 CPU-s, and its parameters' inits are a few computations repeated (12 today, in 4
    programs; measured: XLA's level 0 as the options fails this test on them)."""
    cases = _covering_families(families, tiny.vocab)
    # today GPT-2, Gemma 2 (Llama's layers, and its own norm), DeepSeek-V3, GPT-OSS (the
    # mixtures of experts) and Qwen3-Next: Llama's layers are all in Gemma 2's and DeepSeek's
    assert len(cases) >= 4 and "gpt2" in cases and "llama" not in cases, cases
    programs = _distinct_inits(families, cases, tiny.vocab)
    cheap_all = []
    for model_type, lowered in programs:
        cheap = _init_leaves(lowered, restore.CPU_INIT_COMPILER_OPTIONS)
        default = _init_leaves(lowered, DEFAULT_CPU_OPTIONS)
        assert len(cheap) == len(default) > 0, model_type
        for a, b in zip(cheap, default, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=model_type)
        cheap_all += cheap

    assert len(cheap_all) >= 5  # normal draws, zeros, ones, ...
    assert any(a.dtype == np.float32 and a.std() > 0 for a in cheap_all)  # random values


def test_the_trainers_init_takes_the_cpu_options_and_gives_the_default_values(
    tiny, tmp_path, monkeypatch
):
    """The trainer's init (model and optimizer state) through ``init_program``, with the CPU
    options and with XLA's defaults: bitwise equal."""

    def leaves(options):
        monkeypatch.setattr(restore, "CPU_INIT_COMPILER_OPTIONS", options)
        trainer = tiny.trainer(tmp_path / str(len(list(tmp_path.iterdir()))), steps=1)
        state = trainer.initial_state(lambda key: tiny.model.build(tiny.vocab, key=key))
        return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]

    cheap, default = leaves(restore.CPU_INIT_COMPILER_OPTIONS), leaves(DEFAULT_CPU_OPTIONS)
    assert len(cheap) == len(default) > 10
    for a, b in zip(cheap, default, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_init_compiles_with_the_cpu_options(tiny, tmp_path, monkeypatch):
    """An option XLA does not know fails the compile: the options reach it."""
    monkeypatch.setattr(restore, "CPU_INIT_COMPILER_OPTIONS", {"xla_no_such_option": 1})
    trainer = tiny.trainer(tmp_path, steps=1)
    with pytest.raises(Exception, match="xla_no_such_option"):
        trainer.initial_state(lambda key: tiny.model.build(tiny.vocab, key=key))


def test_a_start_from_given_weights_compiles_no_init(tiny, tmp_path, monkeypatch):
    """Weights given (``initial_weights``: a Hugging Face checkpoint's) replace the fresh
    model: its random init is neither compiled (an option XLA does not know would fail it)
    nor run; the state starts at step 0 with the fresh state's train key, the given weights
    and Adam's zero moments."""
    given = jax.tree.map(lambda x: x + 1.0, tiny.model.build(tiny.vocab, key=jax.random.key(7)))
    fresh = tiny.init(tiny.trainer(tmp_path / "fresh", steps=1))
    monkeypatch.setattr(restore, "CPU_INIT_COMPILER_OPTIONS", {"xla_no_such_option": 1})
    trainer = tiny.trainer(tmp_path / "given", steps=1)
    state = trainer.initial_state(
        lambda key: tiny.model.build(tiny.vocab, key=key), initial_weights=lambda: given
    )
    assert int(state.step) == 0
    np.testing.assert_array_equal(np.asarray(state.key), np.asarray(fresh.key))
    for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(given), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moments = [np.asarray(x) for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
    assert moments and not any(np.any(m) for m in moments)
