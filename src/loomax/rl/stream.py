"""The RL batch stream: a rollout from the current policy every ``rl.steps_per_rollout`` steps.

``RolloutStream`` is both the iterator the trainer reads batches from and a hook: its
``on_step`` (first of the hooks) keeps the state each step produced, from which the next
rollout samples. Rollout ``r`` (steps ``r·k + 1 … r·k + k``, k the steps per rollout) uses
prompts ``r·P … r·P + P − 1`` of the seeded prompt stream (a fresh permutation per epoch)
and the sampler key ``fold_in(PRNGKey(trainer.seed), r)``: both are functions of the
state's step, so a run resumed at a rollout boundary samples what the first run would have.
A checkpoint inside a rollout (a run stopped by a signal or ``trainer.max_train_time``, a
fixed step) also holds the rollout batch being trained on (``ROLLOUT_FILE``), which a run
resumed there reads back instead of sampling; temporary checkpoints wait for a boundary.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from loomax.checkpoint import CheckpointError
from loomax.rl.batches import forward_logps, minibatch, rollout_arrays
from loomax.rl.config import RlConfig
from loomax.rl.rewards import score
from loomax.rl.rollout import generate, row_keys
from loomax.rl.tasks import Prompt
from loomax.train.hooks import Hook, StepInfo

logger = logging.getLogger(__name__)

ROLLOUT_FILE = "rl_rollout.npz"
"""The file of a checkpoint inside a rollout: that rollout's batch arrays and index."""

SAMPLER_STREAM = 1
"""Folded into the run's seed before the rollout index: the sampler's keys."""


class RolloutStream(Hook):
    """Rollout batches for the trainer, sampled from the policy of the step before."""

    priority = 1000  # before every other hook: the state is kept first

    def __init__(
        self,
        config: RlConfig,
        prompts: list[Prompt],
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        *,
        stop_token: int,
        seq_len: int,
        rows_per_step: int,
        seed: int,
        mesh,
        jit,
        place: Callable,
        cast: Callable,
        reference: Callable[[], Any] | None = None,
    ):
        super().__init__()
        self.every = 1
        self.rl, self.prompts, self.decode = config, prompts, decode
        self.prompt_tokens = [encode(p.prompt) for p in prompts]
        self.stop_token, self.seq_len, self.rows = stop_token, seq_len, rows_per_step
        self.seed, self.mesh, self.jit, self.place, self.cast = seed, mesh, jit, place, cast
        self.reference = reference
        self.rollout_rows = rows_per_step * config.minibatches
        self.prompts_per_rollout = self.rollout_rows // config.group_size
        if self.rollout_rows % config.group_size:
            raise ValueError(
                f"rl: trainer.train_batch_size × rl.minibatches = {self.rollout_rows} rows per "
                f"rollout do not split into groups of rl.group_size = {config.group_size}"
            )
        self.state = None
        self._step = 0
        self._rollout = -1
        self._arrays: dict[str, np.ndarray] | None = None
        self._pending: dict[str, float] = {}
        self._perms: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------ the iterator
    def batches(
        self, state, start_step: int, saved: bytes | None = None
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches of steps ``start_step + 1`` on; ``state`` is the state of ``start_step``
        and ``saved`` its checkpoint's ``ROLLOUT_FILE`` (needed inside a rollout)."""
        k = self.rl.steps_per_rollout
        self.state, self._step = state, start_step
        if start_step % k:
            self._arrays = self._read_rollout(saved, start_step // k, start_step)
            self._rollout = start_step // k
        step = start_step
        while True:
            j = step % k
            if j == 0:
                self._arrays, self._rollout = self.make_rollout(step // k), step // k
            yield minibatch(self._arrays, j % self.rl.minibatches, self.rows)
            step += 1

    def prompt_indices(self, rollout: int) -> np.ndarray:
        """The prompts of rollout ``rollout``: a seeded permutation per epoch of the prompts."""
        n, p = len(self.prompts), self.prompts_per_rollout
        stream = np.arange(rollout * p, rollout * p + p)
        out = []
        for i in stream:
            epoch = int(i // n)
            if epoch not in self._perms:
                self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n)}
            out.append(self._perms[epoch][i % n])
        return np.array(out)

    def sampler_key(self, rollout: int) -> jax.Array:
        """The key rollout ``rollout`` samples with."""
        base = jax.random.fold_in(jax.random.PRNGKey(self.seed), SAMPLER_STREAM)
        return jax.random.fold_in(base, rollout)

    def make_rollout(self, rollout: int) -> dict[str, np.ndarray]:
        """Sample, score and prepare rollout ``rollout`` from the kept state's policy."""
        config, g = self.rl, self.rl.group_size
        index = np.repeat(self.prompt_indices(rollout), g)  # G consecutive rows per prompt
        model = self.cast(self.state.model)
        rolled = generate(
            model,
            [self.prompt_tokens[i] for i in index],
            row_keys(self.sampler_key(rollout), len(index)),
            seq_len=self.seq_len,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            stop_token=self.stop_token,
            mesh=self.mesh,
        )
        completions = [
            self.decode(_strip(rolled.completion(i), self.stop_token)) for i in range(len(index))
        ]
        prompts = [self.prompts[i] for i in index]
        scores = score(
            config.rewards, [p.prompt for p in prompts], completions, [p.answer for p in prompts]
        )
        arrays = rollout_arrays(
            rolled,
            scores["total"],
            g,
            scale_rewards=config.scale_rewards,
            drop_flat_groups=config.drop_flat_groups,
        )
        logps = lambda m: forward_logps(  # noqa: E731
            m,
            rolled.tokens,
            self.rows,
            temperature=config.temperature,
            jit=self.jit,
            place=self.place,
        )
        arrays["old_logp"] = logps(model)
        if config.kl_beta > 0 and self.reference is not None:
            arrays["ref_logp"] = logps(self.cast(self.reference()))
        mask = arrays["mask"]
        sampled = np.roll(rolled.logp, -1, axis=1)  # the sampler's log-prob of token t + 1 at t
        gap = np.abs(sampled - arrays["old_logp"]) * mask
        total = scores["total"]
        new = rolled.length - rolled.prompt_len
        metrics = {
            "rl/reward_mean": float(total.mean()),
            "rl/reward_std": float(total.std()),
            "rl/response_length": float(new.mean()),
            "rl/groups_kept": float(arrays["valid"].reshape(-1, g)[:, 0].mean()),
            "rollout/seconds": rolled.seconds,
            "rollout/tokens": float(rolled.new_tokens),
            "rollout/tokens_per_s": rolled.new_tokens / max(rolled.seconds, 1e-9),
            "rollout/sampler_logp_gap": float(gap.sum() / max(mask.sum(), 1.0)),
        }
        metrics.update(
            {f"rl/reward/{k}": float(v.mean()) for k, v in scores.items() if k != "total"}
        )
        self._pending = metrics
        self.last_rollout = (rollout, rolled, scores)
        return arrays

    # ------------------------------------------------------------ the hook
    def _read_rollout(self, saved: bytes | None, rollout: int, step: int) -> dict:
        if saved is None:
            raise CheckpointError(
                f"rl: step {step} is inside rollout {rollout} and its checkpoint holds no "
                f"{ROLLOUT_FILE}: resume from a checkpoint at a rollout boundary"
            )
        with np.load(io.BytesIO(saved)) as f:
            arrays = {k: f[k] for k in f.files}
        if int(arrays.pop("rollout")) != rollout:
            raise CheckpointError(f"rl: the checkpoint's {ROLLOUT_FILE} is not rollout {rollout}")
        return arrays

    def checkpoint_files(self) -> dict[str, bytes]:
        if self._step % self.rl.steps_per_rollout == 0 or self._arrays is None:
            return {}  # at a boundary the next rollout is sampled afresh
        buffer = io.BytesIO()
        np.savez(buffer, rollout=np.asarray(self._rollout), **self._arrays)
        return {ROLLOUT_FILE: buffer.getvalue()}

    def on_step(self, info: StepInfo) -> None:
        self.state, self._step = info.state, info.step
        if self._pending:
            info.log(self._pending)
            self._pending = {}

    def blocks_temporary_saves(self, step: int) -> bool:
        return step % self.rl.steps_per_rollout != 0


def _strip(tokens: list[int], stop: int) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] == stop else tokens


__all__ = ["RolloutStream"]
