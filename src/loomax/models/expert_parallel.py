"""Expert parallelism: a mixture of experts' experts split over the ``expert`` mesh axis.

With ``trainer.mesh.expert`` > 1 each device of the expert axis holds ``E / ways``
experts (the parameter mapping sends ``experts -> expert``) and its own tokens (the batch
is split over ``expert`` too). Inside ``shard_map`` every device:

1. sorts its ``T * k`` assignments by expert (stable) and counts them per expert;
2. all-gathers the counts over the expert axis: each device then knows how many rows it
   sends to and receives from every other;
3. sends each row to the device holding its expert, into a receive buffer of ``ways`` x
   ``T * min(k, E / ways)`` rows (the dropless bound: a token's k experts are distinct, so
   at most ``min(k, E / ways)`` of them live on one device);
4. runs the grouped matmuls on its experts (their work follows the groups: ``T * k`` rows
   a device on average, which the grouped matmul is told for the plan's count, not the
   buffer's size; ``models/expert_ffn.py``, whose backward may keep only those rows), and
   returns every row to its sender by the reverse collective;
5. restores token order and combines the k results with the routing weights; with the
   experts' ``mlp`` split over ``model`` (tensor parallelism) the partial outputs are
   summed over it.

Two forms of the collective give the same result: ``ragged`` (``jax.lax.ragged_all_to_all``,
only the routed rows travel: GPU and TPU; one exchange per local expert, so the rows land
grouped by local expert, the routed ones first, and nothing is sorted there or back) and
``padded`` (``jax.lax.all_to_all`` of the whole fixed-size buffer, sender ``i`` at slot
``i``, then sorted by local expert and back: what XLA:CPU can run, as it has no
ragged-all-to-all). Routing,
capacity drops and the router statistics are computed before, on the global arrays, so
the layer gives the single-device result whatever the split.
"""

from __future__ import annotations

import math

import haliax as hax
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from loomax.config import ConfigError
from loomax.mesh import EXPERT_AXIS
from loomax.models.axes import Batch, Embed, Experts, Mlp
from loomax.models.expert_ffn import expert_ffn
from loomax.models.grouped_matmul import grouped_matmul, grouped_matmul_grads
from loomax.models.mlp_activations import activation
from loomax.models.remat import name_activation

FORMS = ("ragged", "padded")
"""How rows travel between devices: ``ragged_all_to_all`` or a fixed-size ``all_to_all``."""


def _concrete_mesh():
    """The device mesh in context (also inside ``jit``); None without one."""
    from jax._src.mesh import get_concrete_mesh

    mesh = get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh


def expert_ways() -> int:
    """Devices the experts are split over in the mesh in context (1: no expert parallelism)."""
    mesh = _concrete_mesh()
    return 1 if mesh is None else dict(mesh.shape).get(EXPERT_AXIS, 1)


def check_expert_split(num_experts: int, ways: int) -> None:
    """Raise ``ConfigError`` unless the experts split evenly over the expert axis."""
    if num_experts % ways:
        raise ConfigError(
            f"model.moe.num_experts ({num_experts}) must be a multiple of trainer.mesh.expert ({ways})"
        )


def default_form(mesh) -> str:
    """``ragged`` on GPU and TPU, ``padded`` elsewhere (XLA:CPU has no ragged-all-to-all)."""
    return "ragged" if mesh.devices.flat[0].platform in ("gpu", "tpu") else "padded"


def _mapped(mesh, logical: str, size: int):
    """The compute mapping's mesh axes for ``logical`` as a spec entry, if ``size`` divides."""
    target = (hax.partitioning.current_thread_local_mapping() or {}).get(logical)
    names = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    names = tuple(n for n in names if mesh.shape[n] > 1)
    if not names or size % math.prod(mesh.shape[n] for n in names):
        return None
    return names


def capacity_keep(flat: jax.Array, num_experts: int, capacity: int) -> jax.Array:
    """Which of the assignments ``flat [N]`` (expert ids) fit their expert's ``capacity``,
    first come first served in order (as ``MoeMlp`` on one device)."""
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    start = jnp.cumsum(sizes) - sizes
    rank = jnp.arange(flat.shape[0]) - start[flat[order]]
    return jnp.zeros(flat.shape, bool).at[order].set(rank < capacity)


def parallel_experts(mlp, t: jax.Array, weights: jax.Array, experts: jax.Array, *, form=None):
    """``MoeMlp._experts`` over the expert axis: ``(y [T, D], sizes [E], dropped,
    recomputed)``, the last the fraction of devices whose routed rows exceed the rows kept
    for the backward (``model.moe.saved_rows``; 0 when the whole buffer is kept).

    ``t [T, D]`` are the tokens (rows in batch-major order), ``weights``/``experts [T, k]``
    their routing. ``form`` is one of ``FORMS`` (default: ``default_form``).
    """
    mesh = _concrete_mesh()
    ways, E = expert_ways(), mlp.moe.num_experts
    check_expert_split(E, ways)
    T, k = experts.shape
    flat = experts.reshape(-1)
    sizes = jnp.bincount(flat, length=E)
    dropped = jnp.zeros((), jnp.int32)
    capacity = mlp.moe.capacity(T)
    if capacity is not None:  # dropped assignments go to a sentinel expert E, weight 0
        keep = capacity_keep(flat, E, capacity)
        dropped = T * k - jnp.sum(keep)
        weights = jnp.where(keep.reshape(T, k), weights, 0.0)
        experts = jnp.where(keep, flat, E).reshape(T, k)
    rows = _mapped(mesh, Batch, T)
    tp = _mapped(mesh, Mlp, mlp.gate.resolve_axis(Mlp).size)
    gate = mlp.gate.rearrange((Experts, Embed, Mlp)).array
    up = mlp.up.rearrange((Experts, Embed, Mlp)).array
    down = mlp.down.rearrange((Experts, Mlp, Embed)).array
    local = _Local(mlp, ways, form or default_form(mesh), tp)
    w_in, w_out = P(EXPERT_AXIS, None, tp), P(EXPERT_AXIS, tp, None)
    y, recomputed = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(rows, None), P(rows, None), P(rows, None), w_in, w_in, w_out),
        out_specs=(P(rows, None), P(mesh.axis_names)),
        check_vma=False,  # the TPU's megablox kernel (Pallas) declares no varying axes
    )(t, weights, experts, gate, up, down)
    return y, sizes, dropped, jnp.mean(recomputed)


class _Local:
    """What one device does inside ``shard_map`` (see the module docstring)."""

    def __init__(self, mlp, ways: int, form: str, tp):
        if form not in FORMS:
            raise ValueError(f"expert-parallel form must be one of {FORMS}, got {form!r}")
        self.moe, self.act, self.ways, self.form, self.tp = mlp.moe, mlp.act, ways, form, tp

    def __call__(self, t, weights, experts, gate, up, down):
        T, k = experts.shape
        E, ways, n = self.moe.num_experts, self.ways, T * k
        local_e = E // ways
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # the sentinel (dropped) last
        sizes = jnp.bincount(flat, length=E)
        every = jax.lax.all_gather(sizes, EXPERT_AXIS)  # [ways, E]: each sender's counts
        per_shard = every.reshape(ways, ways, local_e)  # [sender, receiver, local expert]
        me = jax.lax.axis_index(EXPERT_AXIS)
        xs = t[order // k]
        cap = T * min(k, local_e)  # rows one sender can route to one device (distinct top-k)
        group_sizes = jnp.sum(per_shard[:, me], axis=0)  # rows of each local expert here
        if self.form == "ragged":  # rows land grouped by local expert: no sort here
            plan = _GroupedExchange(every, per_shard, me, local_e)
            recv = plan.send(xs, ways * cap)
            out = self._matmuls(recv, group_sizes, gate, up, down, n)
            ys = plan.back(out, n)  # [n, D], in ``order``
        else:
            sent = jnp.sum(per_shard, axis=-1)  # [sender, receiver] rows
            starts = jnp.cumsum(sent, axis=1) - sent  # each receiver's rows start, per sender
            recv = self._send(xs, sent, starts, me, cap)  # [ways * cap, D], sender i at i * cap
            mine = per_shard[:, me]  # [sender, local expert]
            pos = jnp.arange(cap)
            ends = jnp.cumsum(mine, axis=1)
            slot_expert = jax.vmap(lambda e: jnp.searchsorted(e, pos, side="right"))(ends)
            slot_expert = slot_expert.reshape(-1)  # local expert of each slot; local_e = empty
            order2 = jnp.argsort(slot_expert, stable=True)
            out = self._matmuls(recv[order2], group_sizes, gate, up, down, n)
            back = jnp.zeros_like(out).at[order2].set(out)
            ys = self._return(back, sent, starts, me, cap, n)  # [n, D], in ``order``
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=order.dtype))
        y = name_activation(ys[inverse].reshape(T, k, -1), "moe_out")
        combined = jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))
        if self.tp:
            combined = jax.lax.psum(combined, self.tp)
        over = jnp.sum(group_sizes) > self.moe.kept_rows(n, recv.shape[0])
        return combined.astype(t.dtype), over.astype(jnp.float32)[None]

    def _matmuls(self, xs, group_sizes, gate, up, down, routed: int):
        """The experts' matmuls over the receive buffer, of which ``routed`` rows (``T * k``,
        the mean over the expert axis: every device sends as many) are routed rows."""
        settings = {"impl": self.moe.matmul, "block": self.moe.matmul_block}
        # the buffer's rows past the groups are never read: not sent home, skipped by the
        # next grouped matmul and by the weight gradients (megablox's tgmm masks by group)
        mm = lambda a, w, sizes: grouped_matmul(  # noqa: E731
            a, w, sizes, rows=min(routed, a.shape[0]), zero_rest=False, **settings
        )
        mm_grads = lambda a, w, sizes, dy: grouped_matmul_grads(  # noqa: E731
            a, w, sizes, dy, rows=min(routed, a.shape[0]), **settings
        )
        act = lambda g: activation(self.act)(hax.named(g, ("tokens", Mlp))).array  # noqa: E731
        weights = (w.astype(xs.dtype) for w in (gate, up, down))
        keep = self.moe.kept_rows(routed, xs.shape[0])
        return expert_ffn(xs, group_sizes, *weights, mm=mm, mm_grads=mm_grads, act=act, keep=keep)

    def _send(self, xs, sent, starts, me, cap):
        """The padded form: each sorted row to its expert's device, ``[ways * cap, D]``, sender
        i at ``i * cap``."""
        shard, slot = self._slots(sent[me], starts[me], xs.shape[0])
        buf = jnp.zeros((self.ways, cap, xs.shape[-1]), xs.dtype)
        buf = buf.at[shard, slot].set(xs, mode="drop")
        return jax.lax.all_to_all(buf, EXPERT_AXIS, 0, 0).reshape(self.ways * cap, -1)

    def _return(self, back, sent, starts, me, cap, n):
        """The reverse of ``_send``: each device's ``n`` rows home, in sorted order."""
        home = jax.lax.all_to_all(back.reshape(self.ways, cap, -1), EXPERT_AXIS, 0, 0)
        shard, slot = self._slots(sent[me], starts[me], n)
        return home.at[shard, slot].get(mode="fill", fill_value=0)

    def _slots(self, counts, starts, n):
        """Each sorted row's (receiver, slot in that receiver's chunk); out of range when dropped."""
        r = jnp.arange(n)
        shard = jnp.searchsorted(jnp.cumsum(counts), r, side="right")
        slot = r - starts[jnp.minimum(shard, self.ways - 1)]
        return shard, slot


class _GroupedExchange:
    """The ragged form's exchange: one ``ragged_all_to_all`` per local expert, each sender's
    rows landing in the receiver's buffer already grouped by local expert (expert ``e``'s rows
    from sender 0, then sender 1, ...; every group after the one before), so the grouped
    matmuls run on the buffer as it arrives and no row is sorted on the way there or back.

    ``every [ways, E]``: each device's rows per expert (all-gathered); ``per_shard`` the same
    as ``[sender, receiver, local expert]``; ``me`` this device's index on the expert axis.
    """

    def __init__(self, every, per_shard, me, local_e: int):
        self.local_e, self.me, self.per_shard = local_e, me, per_shard
        # where expert g's rows start in each sender's sorted rows: [sender, E]
        self.sorted_start = jnp.cumsum(every, axis=1) - every
        # where local expert e's group starts in each receiver's buffer: [receiver, local_e]
        totals = jnp.sum(per_shard, axis=0)
        self.group_start = jnp.cumsum(totals, axis=1) - totals
        # where each sender's rows start inside that group: [sender, receiver, local_e]
        self.within = jnp.cumsum(per_shard, axis=0) - per_shard

    def send(self, xs, rows: int):
        """``xs`` (sorted by expert) to the experts' devices: ``[rows, D]``, grouped."""
        me, ps = self.me, self.per_shard
        out = jnp.zeros((rows, xs.shape[-1]), xs.dtype)
        for e in range(self.local_e):
            experts = jnp.arange(ps.shape[1]) * self.local_e + e  # expert e of every receiver
            out = jax.lax.ragged_all_to_all(
                xs,
                out,
                self.sorted_start[me, experts],  # my rows for each receiver's expert e
                ps[me, :, e],
                self.group_start[:, e] + self.within[me, :, e],  # where they land there
                ps[:, me, e],  # what each sender sends me for my expert e
                axis_name=EXPERT_AXIS,
            )
        return out

    def back(self, out, n: int):
        """The reverse of ``send``: every row home, ``[n, D]`` in its sender's sorted order."""
        me, ps = self.me, self.per_shard
        home = jnp.zeros((n, out.shape[-1]), out.dtype)
        for e in range(self.local_e):
            mine = me * self.local_e + e  # my expert e, as each sender numbers it
            home = jax.lax.ragged_all_to_all(
                out,
                home,
                self.group_start[me, e] + self.within[:, me, e],  # each sender's rows here
                ps[:, me, e],
                self.sorted_start[:, mine],  # where they sit in that sender's sorted rows
                ps[me, :, e],  # what each expert device returns to me
                axis_name=EXPERT_AXIS,
            )
        return home
