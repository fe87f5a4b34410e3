"""Compile an RL run's two programs for a topology: the rollout and the GRPO update.

``loomax rl`` runs two compiled programs on the training mesh: the rollout
(``rl.rollout``: the prompts × ``rl.group_size`` rows prefilled, then sampled up to
``rl.max_new_tokens`` with the KV cache) and the trainer's step on a rollout minibatch
(``rl.loss.grpo_loss``: tokens, response mask, advantages, old and reference log-probs).
``compile_rl`` builds both as the run would, with abstract arrays only (the policy's state
from ``Trainer.abstract_state``, the inputs as sharded ``ShapeDtypeStruct``s), compiles each
and reports each one's memory per device (``compile.CompileResult``) and whether it fits.
The policy is compiled in the run's compute precision for the rollout, as ``loomax rl``
casts it; the old log-prob forward (the update's forward without its backward) is not
compiled apart.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass

import haliax as hax
import jax
import jax.numpy as jnp

from loomax.lm.weights import initial_model
from loomax.mesh import batch_sharding
from loomax.models.decoding.generate import prompt_bucket
from loomax.plan.compile import CompileResult, _memory, _no_cache_writes, _shard_bytes
from loomax.plan.topology import Topology
from loomax.rl.config import TrainRlConfig
from loomax.rl.loss import grpo_loss
from loomax.rl.rollout import _program
from loomax.train import Trainer


@dataclass
class RlCompileResult:
    """The rollout's and the update's compile results (bytes per device, fits)."""

    rollout: CompileResult
    update: CompileResult

    @property
    def fits(self) -> bool | None:
        """Both fit (None: a device's memory is unknown)."""
        both = (self.rollout.fits, self.update.fits)
        return False if False in both else (None if None in both else True)

    def to_json(self) -> dict:
        return {"rollout": self.rollout.to_json(), "update": self.update.to_json()}


def is_rl_config(path: str | None) -> bool:
    """Whether the run YAML at ``path`` is a ``loomax rl`` run (it has an ``rl`` section)."""
    if not path:
        return False
    from pathlib import Path

    import yaml

    from loomax.config import _compose

    try:
        root = _compose(Path(path))
    except (OSError, yaml.YAMLError):
        return False  # the run's parse names what is wrong
    if not isinstance(root, yaml.MappingNode):
        return False
    return any(getattr(key, "value", None) == "rl" for key, _ in root.value)


def rl_vocab_size(config: TrainRlConfig) -> int:
    """``model.vocab_size``, else the BPE ``loomax rl`` trains (``rl.tokenizer_vocab_size``);
    a named tokenizer without ``model.vocab_size`` is a ``ConfigError`` (nothing is read)."""
    from loomax.config import ConfigError

    if config.model.vocab_size is not None:
        return config.model.vocab_size
    if config.rl.tokenizer is None:
        return config.rl.tokenizer_vocab_size
    raise ConfigError(
        f"model.vocab_size is null and rl.tokenizer is {config.rl.tokenizer!r}: pass "
        "--model.vocab_size N (compiling reads no tokenizer)"
    )


def compile_rl(config: TrainRlConfig, topology: Topology) -> RlCompileResult:
    """Compile ``config``'s rollout and GRPO update over ``topology``'s devices, and report."""
    rl, vocab_size = config.rl, rl_vocab_size(config)
    scratch = tempfile.mkdtemp(prefix="loomax-compile-rl-")
    try:
        trainer_config = config.trainer.for_scratch_run(scratch)
        steps, schedule = trainer_config.num_train_steps, trainer_config.batch_schedule
        trainer = Trainer(
            trainer_config,
            config.optimizer.build(steps, schedule),
            grpo_loss(rl),
            run_id="compile",
            lr_schedule=config.optimizer.lr_scheduler(steps, schedule),
            devices=topology.devices,
            qk_clip_tau=config.optimizer.qk_clip_tau,
        )
        state = trainer.abstract_state(initial_model(config, vocab_size))
        rows, seq_len = schedule.sizes[0], config.model.seq_len
        params = config.model.param_count(vocab_size)
        update = _result(trainer, topology, params, rows * seq_len)
        update.state_bytes = _shard_bytes(state)
        batch = _update_batch(trainer, rows, seq_len, with_ref=rl.kl_beta > 0)
        update.batch_bytes = _shard_bytes(batch)
        _compile(update, topology, lambda: trainer.trace_step(state, batch))
        update.notes.append(
            f"the GRPO update on {rows} rollout rows of {seq_len} (tokens, mask, advantages, "
            f"old{' and reference' if rl.kl_beta > 0 else ''} log-probs)"
        )
        rollout_rows = rows * rl.minibatches
        rollout = _result(trainer, topology, params, rollout_rows * rl.max_new_tokens)
        model = _compute_model(state.model, trainer_config.policy.compute_dtype)
        inputs = _rollout_inputs(trainer, rollout_rows, seq_len)
        rollout.state_bytes = _shard_bytes(model)
        rollout.batch_bytes = _shard_bytes(inputs)
        width = prompt_bucket(max(1, seq_len - rl.max_new_tokens), seq_len)
        run = _program(rl.temperature, rl.top_p, 0, seq_len, width, rl.max_new_tokens)

        def trace():
            with hax.axis_mapping({}):  # as rl.rollout.generate: rows whole, split by inputs
                return run.trace(model, *inputs)

        _compile(rollout, topology, trace)
        rollout.notes.append(
            f"the rollout: {rollout_rows // rl.group_size} prompts × {rl.group_size} samples, "
            f"prompts up to {width} tokens, {rl.max_new_tokens} new tokens, a KV cache of "
            f"{seq_len} positions, the policy in {jnp.dtype(trainer_config.policy.compute_dtype).name}"
        )
        trainer.finish()
        return RlCompileResult(rollout, update)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _result(trainer: Trainer, topology: Topology, params: int, tokens: int) -> CompileResult:
    chip = topology.chip.name if topology.chip else str(topology.devices[0].device_kind)
    result = CompileResult(
        topology.name,
        topology.num_devices,
        dict(trainer.mesh.shape),
        chip,
        topology.hbm_per_device,
        platform=topology.platform,
        memory_fraction=topology.memory_fraction,
    )
    result.params, result.tokens_per_step = params, tokens
    return result


def _compile(result: CompileResult, topology: Topology, trace) -> None:
    """Trace, compile and read ``result``'s memory; an out-of-memory compile is ``fits=False``."""
    start = time.perf_counter()
    try:
        with _no_cache_writes(topology):
            compiled = trace().lower().compile()
    except Exception as e:  # noqa: BLE001 - XLA reports "does not fit" as a compile error
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        result.fits, result.error = False, f"XLA: {str(e).strip()[:300]}"
        return
    finally:
        result.compile_s = time.perf_counter() - start
    _memory(result, compiled)


def _struct(trainer: Trainer, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(trainer.mesh, len(shape)))


def _update_batch(trainer: Trainer, rows: int, seq_len: int, *, with_ref: bool) -> dict:
    """The rollout minibatch the GRPO loss reads (``rl.batches.minibatch``), abstract."""
    batch = {
        "tokens": _struct(trainer, (rows, seq_len), jnp.int32),
        "mask": _struct(trainer, (rows, seq_len), jnp.float32),
        "advantages": _struct(trainer, (rows,), jnp.float32),
        "old_logp": _struct(trainer, (rows, seq_len), jnp.float32),
    }
    if with_ref:
        batch["ref_logp"] = _struct(trainer, (rows, seq_len), jnp.float32)
    return batch


def _rollout_inputs(trainer: Trainer, rows: int, seq_len: int) -> tuple:
    """The rollout's prompt buffer, prompt lengths and per-row keys, abstract."""
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    return (
        _struct(trainer, (rows, seq_len), jnp.int32),
        _struct(trainer, (rows,), jnp.int32),
        _struct(trainer, (rows, *key.shape), key.dtype),
    )


def _compute_model(model, dtype):
    """The abstract policy cast as ``loomax rl`` casts it for sampling (floats to ``dtype``)."""

    def cast(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct) and jnp.issubdtype(leaf.dtype, jnp.floating):
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
        return leaf

    return jax.tree.map(cast, model)


def rl_text(result: RlCompileResult) -> str:
    """The two programs' memory per device, one block each."""
    lines = []
    for name, r in (("rollout", result.rollout), ("update", result.update)):
        hbm = f" of {r.hbm_bytes / 2**30:.2f} GiB" if r.hbm_bytes else ""
        verdict = {True: "FITS", False: "DOES NOT FIT", None: "fit unknown"}[r.fits]
        lines.append(
            f"{name}: {r.total_bytes / 2**30:.3f} GiB per device{hbm}: {verdict} "
            f"(state {r.state_bytes / 2**30:.3f} GiB, inputs {r.batch_bytes / 2**20:.2f} MiB, "
            f"temporaries {r.temp_bytes / 2**30:.3f} GiB; compiled in {r.compile_s:.1f} s)"
        )
        lines += [f"  - {n}" for n in r.notes]
        if r.error:
            lines.append(f"  - {r.error}")
    mesh = " x ".join(f"{k}={v}" for k, v in result.update.mesh.items() if v > 1) or "one device"
    head = f"{result.update.topology} ({result.update.devices} devices, mesh {mesh}), RL run:"
    return "\n".join([head, *lines])


__all__ = ["RlCompileResult", "compile_rl", "is_rl_config", "rl_text", "rl_vocab_size"]
