"""The routed experts of a mixture of experts, per device: with or without an expert axis.

Every device routes, sorts, multiplies and combines its own tokens inside ``shard_map``
(the tokens split as the compute mapping splits their axes: batch over replica, data and
expert, positions over context), so under data parallelism and FSDP a device holds its own
``T * k`` routed rows, never the batch's; only the counts per expert are summed over the
devices (the router statistics). With ``trainer.mesh.expert`` > 1 each device of the expert
axis holds ``E / ways`` experts (the parameter mapping sends ``experts -> expert``) and its
own tokens. Every device:

1. sorts its ``T * k`` assignments by expert (stable) and counts them per expert; with one
   way (no expert axis) the sorted rows are the grouped matmuls' buffer and steps 2-3 and the
   return are skipped;
2. all-gathers the counts over the expert axis: each device then knows how many rows it
   sends to and receives from every other;
3. sends each row to the device holding its expert, one exchange each way
   (``_Exchange``), into a receive buffer of ``ways`` x ``T * min(k, E / ways)`` rows (the
   dropless bound: a token's k experts are distinct, so at most ``min(k, E / ways)`` of them
   live on one device; ``model.moe.receive_buffer`` makes it smaller, a receiver then taking
   at most its share of a sender's rows, the rest dropped), and regroups what arrived by
   local expert (a gather by a permutation computed from the counts);
4. runs the grouped matmuls on its experts (their work follows the groups: ``T * k`` rows
   a device on average, which the grouped matmul is told for the plan's count, not the
   buffer's size; ``models/moe/expert_ffn.py``, whose backward may keep only those rows), and
   returns every row to its sender by the reverse exchange;
5. restores token order and combines the k results with the routing weights; with the
   experts' ``mlp`` split over ``model`` (tensor parallelism) the partial outputs are
   summed over it.

Two forms of the exchange give the same result: ``ragged`` (one
``jax.lax.ragged_all_to_all`` each way, offsets per receiver: only the routed rows travel;
GPU and TPU) and ``padded`` (``jax.lax.all_to_all`` of a fixed-size buffer, ``cap`` slots per
sender: what XLA:CPU can run, as it has no ragged-all-to-all). They share the regrouping.
Routing runs per token on the sharded arrays; with ``capacity_factor`` (off by default) which
assignments fit is decided on the global token order (a sort of the ``T * k`` expert ids,
integers, not rows), so the layer gives the single-device result whatever the split.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from loomax.config import ConfigError
from loomax.mesh import EXPERT_AXIS, current_mesh, mapped_axes, target_platform
from loomax.models.axes import Embed, Experts, Mlp
from loomax.models.blocks.mlp_activations import gated_unit
from loomax.models.blocks.remat import name_activation
from loomax.models.moe.expert_ffn import expert_ffn
from loomax.models.moe.grouped_matmul import grouped_matmul, grouped_matmul_grads

FORMS = ("ragged", "padded")
"""How rows travel between devices: ``ragged_all_to_all`` or a fixed-size ``all_to_all``."""


def check_expert_split(num_experts: int, ways: int) -> None:
    """Raise ``ConfigError`` unless the experts split evenly over the expert axis."""
    if num_experts % ways:
        raise ConfigError(
            f"model.moe.num_experts ({num_experts}) must be a multiple of trainer.mesh.expert ({ways})"
        )


def default_form() -> str:
    """``ragged`` on GPU and TPU, ``padded`` elsewhere (XLA:CPU has no ragged-all-to-all)."""
    return "ragged" if target_platform() in ("gpu", "tpu") else "padded"


def capacity_keep(flat: jax.Array, num_experts: int, capacity: int) -> jax.Array:
    """Which of the assignments ``flat [N]`` (expert ids) fit their expert's ``capacity``,
    first come first served in order (as ``MoeMlp`` on one device)."""
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    start = jnp.cumsum(sizes) - sizes
    rank = jnp.arange(flat.shape[0]) - start[flat[order]]
    return jnp.zeros(flat.shape, bool).at[order].set(rank < capacity)


def routed_experts(
    mlp, x: jax.Array, weights: jax.Array, experts: jax.Array, lead: tuple, *, form=None
):
    """``MoeMlp``'s experts for tokens ``x [*lead, D]`` routed to ``experts`` with ``weights``
    (``[*lead, k]``): ``(y [*lead, D], sizes [E], dropped, recomputed)``. ``sizes`` counts the
    assignments per expert over all devices, ``recomputed`` is the fraction of devices whose
    routed rows exceed the rows kept for the backward (``model.moe.saved_rows``; 0 when the
    whole buffer is kept). ``lead`` are the token axes (``haliax.Axis``), whose compute
    mapping decides how the tokens are split; ``form`` is one of ``FORMS`` (default:
    ``default_form``).
    """
    mesh = current_mesh()
    ways = 1 if mesh is None else dict(mesh.shape).get(EXPERT_AXIS, 1)
    E = mlp.moe.num_experts
    check_expert_split(E, ways)
    T, k = math.prod(experts.shape[:-1]), experts.shape[-1]
    dropped = jnp.zeros((), jnp.int32)
    chosen = experts  # the router's choices (what the statistics count)
    capacity = mlp.moe.capacity(T)
    if capacity is not None:  # dropped assignments go to a sentinel expert E, weight 0
        keep = capacity_keep(experts.reshape(-1), E, capacity).reshape(experts.shape)
        dropped = T * k - jnp.sum(keep)
        weights = jnp.where(keep, weights, 0.0)
        experts = jnp.where(keep, experts, E)
    gate = mlp.gate.rearrange((Experts, Embed, Mlp)).array
    up = mlp.up.rearrange((Experts, Embed, Mlp)).array
    down = mlp.down.rearrange((Experts, Mlp, Embed)).array
    biases = None  # the experts' biases (gpt-oss: moe.expert_bias)
    if mlp.gate_bias is not None:
        in_b = tuple(b.rearrange((Experts, Mlp)).array for b in (mlp.gate_bias, mlp.up_bias))
        biases = (*in_b, mlp.down_bias.rearrange((Experts, Embed)).array)
    adapters = expert_adapters(mlp, x.dtype)
    if mesh is None:  # no mesh: one device, no collective
        local = _Local(mlp, 1, "padded", None, ())
        y, sizes, _, over = local(x, weights, experts, chosen, gate, up, down, biases, adapters)
        return y, sizes, dropped, over[0]
    specs = tuple(mapped_axes(mesh, a.name, a.size) for a in lead)
    token_axes = tuple(
        n for spec in specs if spec for n in ((spec,) if isinstance(spec, str) else spec)
    )
    tp = mapped_axes(mesh, Mlp, mlp.gate.resolve_axis(Mlp).size)
    local = _Local(mlp, ways, form or default_form(), tp, token_axes)
    on_experts = EXPERT_AXIS if EXPERT_AXIS in mesh.axis_names else None
    w_in, w_out = P(on_experts, None, tp), P(on_experts, tp, None)
    tokens = P(*specs, None)
    b_specs = P() if biases is None else (P(on_experts, tp), P(on_experts, tp), P())
    a_specs = P()  # the adapters' A [E, in, r] and B [E, r, out]: split as their weight's
    if adapters is not None:
        pairs = ((P(on_experts), w_in), (P(on_experts), w_in), (w_out, P(on_experts)))
        a_specs = tuple(
            P() if pair is None else specs for pair, specs in zip(adapters, pairs, strict=True)
        )
    # inside a shard_map already manual over some axes (a pipeline's stage): over the others
    context = jax.sharding.get_abstract_mesh()
    manual = set(getattr(context, "manual_axes", ()) or ())
    free = tuple(a for a in mesh.axis_names if a not in manual)
    y, sizes, unreceived, over = jax.shard_map(
        local,
        mesh=context if manual else mesh,
        in_specs=(tokens, tokens, tokens, tokens, w_in, w_in, w_out, b_specs, a_specs),
        out_specs=(tokens, P(), P(), P(free)),
        axis_names=set(free),
        check_vma=False,  # the TPU's megablox kernel (Pallas) declares no varying axes
    )(x, weights, experts, chosen, gate, up, down, biases, adapters)
    return y, sizes, dropped + unreceived, jnp.mean(over)


def expert_adapters(mlp, dtype):
    """The experts' LoRA factors (``expert_ffn.Adapters``) of ``MoeMlp`` ``mlp`` in
    ``dtype``, or None when it has none."""
    found = (mlp.gate_lora, mlp.up_lora, mlp.down_lora)
    if all(a is None for a in found):
        return None
    return tuple(None if a is None else a.factors(dtype) for a in found)


class _Local:
    """What one device does inside ``shard_map`` (see the module docstring)."""

    def __init__(self, mlp, ways: int, form: str, tp, token_axes: tuple[str, ...]):
        if form not in FORMS:
            raise ValueError(f"expert-parallel form must be one of {FORMS}, got {form!r}")
        self.moe, self.act, self.ways, self.form, self.tp = mlp.moe, mlp.act, ways, form, tp
        self.token_axes = token_axes

    def __call__(self, x, weights, experts, chosen, gate, up, down, biases=None, adapters=None):
        lead, D = x.shape[:-1], x.shape[-1]
        k = experts.shape[-1]
        t, experts, weights = x.reshape(-1, D), experts.reshape(-1, k), weights.reshape(-1, k)
        T, E, ways = t.shape[0], self.moe.num_experts, self.ways
        n = T * k
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # the sentinel (dropped) last
        sizes = jnp.bincount(flat, length=E)
        xs = t[order // k]
        dropped = jnp.zeros((), jnp.int32)
        if ways == 1:  # every expert here: the sorted rows are the buffer
            out = self._matmuls(xs, sizes, gate, up, down, n, biases, adapters)
            kept = jnp.sum(sizes)
            ys = out if self.moe.capacity_factor is None else _first(out, kept)
            over = kept > self.moe.kept_rows(n, n)
        else:
            every = jax.lax.all_gather(sizes, EXPERT_AXIS)  # [ways, E]: each sender's counts
            per_shard = every.reshape(ways, ways, E // ways)  # [sender, receiver, local expert]
            me = jax.lax.axis_index(EXPERT_AXIS)
            cap = self.moe.sender_rows(T, ways)
            exchange = _Exchange(per_shard, me, cap, self.form)
            dropped = exchange.dropped
            recv = exchange.there(xs)  # [ways * cap, D], grouped by local expert
            out = self._matmuls(recv, exchange.group_sizes, gate, up, down, n, biases, adapters)
            ys = exchange.back(out, n)  # [n, D], in ``order``
            over = jnp.sum(exchange.group_sizes) > self.moe.kept_rows(n, recv.shape[0])
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=order.dtype))
        y = name_activation(ys[inverse].reshape(T, k, -1), "moe_out")
        combined = jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))
        if self.tp:
            combined = jax.lax.psum(combined, self.tp)
        if biases is not None:  # the down projection's bias, once (after the model-axis sum)
            down_b = jnp.take(biases[2], experts, axis=0, mode="fill", fill_value=0)
            combined = combined + jnp.einsum("tkd,tk->td", down_b, weights.astype(down_b.dtype))
        chosen = jnp.bincount(chosen.reshape(-1), length=E)  # before any capacity drop
        if self.token_axes:  # the counts of every device's tokens
            chosen, dropped = jax.lax.psum((chosen, dropped), self.token_axes)
        y = combined.astype(t.dtype).reshape(*lead, D)
        return y, chosen, dropped, over.astype(jnp.float32)[None]

    def _matmuls(self, xs, group_sizes, gate, up, down, routed: int, biases=None, adapters=None):
        """The experts' matmuls over the receive buffer, of which ``routed`` rows (``T * k``,
        the mean over the expert axis: every device sends as many) are routed rows;
        ``biases``: the local experts' gate and up biases first (or None); ``adapters``: the
        local experts' LoRA factors (``expert_ffn.Adapters``) or None."""
        settings = {"impl": self.moe.matmul, "block": self.moe.matmul_block}
        # the buffer's rows past the groups are never read: not sent home, skipped by the
        # next grouped matmul and by the weight gradients (megablox's tgmm masks by group)
        mm = lambda a, w, sizes: grouped_matmul(  # noqa: E731
            a, w, sizes, rows=min(routed, a.shape[0]), zero_rest=False, **settings
        )
        mm_grads = lambda a, w, sizes, dy: grouped_matmul_grads(  # noqa: E731
            a, w, sizes, dy, rows=min(routed, a.shape[0]), **settings
        )
        glu = gated_unit(self.act, self.moe.swiglu_limit, self.moe.swiglu_alpha)
        weights = (w.astype(xs.dtype) for w in (gate, up, down))
        keep = self.moe.kept_rows(routed, xs.shape[0])
        in_b = None if biases is None else biases[:2]
        return expert_ffn(
            xs, group_sizes, *weights, mm=mm, mm_grads=mm_grads, glu=glu, keep=keep, biases=in_b,
            adapters=adapters,
        )  # fmt: skip


def _first(rows: jax.Array, count: jax.Array) -> jax.Array:
    """``rows`` with those from ``count`` on zeroed (a kernel may leave them unwritten)."""
    return jnp.where((jnp.arange(rows.shape[0]) < count)[:, None], rows, 0)


def _segment(starts: jax.Array, sizes: jax.Array, slots: jax.Array):
    """For each of ``slots``: the segment holding it (of segments ``starts``/``sizes``, in
    order, starts nondecreasing), its offset there, and whether any segment holds it."""
    segment = jnp.searchsorted(starts + sizes, slots, side="right")
    segment = jnp.minimum(segment, starts.shape[0] - 1)
    offset = slots - starts[segment]
    return segment, offset, (offset >= 0) & (offset < sizes[segment])


class _Exchange:
    """One exchange each way between the devices of the expert axis, and the regrouping of
    what arrives.

    Every sender's rows for this device arrive as one chunk (sender-major: sender 0's chunk,
    then sender 1's, ...; each chunk sorted by local expert): ``ragged`` packs the chunks
    (one ``ragged_all_to_all``, offsets per receiver), ``padded`` gives each sender ``cap``
    slots (one ``all_to_all`` of the fixed-size buffer). A gather by a permutation computed
    from the counts (no sort) then regroups the rows by local expert (expert 0's rows from
    sender 0, 1, ..., then expert 1's), the layout the grouped matmuls read; ``back`` undoes
    it and returns every row to its sender by the reverse exchange. Both forms share the
    regrouping; they differ in the collective and where the chunks start.

    ``per_shard [sender, receiver, local expert]``: rows routed, from every device's counts;
    ``me`` this device's index on the expert axis; ``cap`` the padded form's slots a sender.
    """

    def __init__(self, per_shard, me, cap: int, form: str):
        ways, _, local_e = per_shard.shape
        self.form, self.cap, self.ways = form, cap, ways
        routed = jnp.sum(per_shard, axis=-1)  # [sender, receiver] rows routed
        # where my rows for each receiver start in my sorted rows; where each sender's rows
        # for me sit in its own sorted rows (the rows routed, accepted or not)
        self.send_start = (jnp.cumsum(routed, axis=1) - routed)[me]
        self.home_at = (jnp.cumsum(routed, axis=1) - routed)[:, me]
        self.routed_sent = routed[me]
        # a receiver takes at most ``cap`` rows from each sender, the first in expert order
        # (``model.moe.receive_buffer``; the dropless bound takes them all)
        before = jnp.cumsum(per_shard, axis=-1) - per_shard
        per_shard = jnp.clip(cap - before, 0, per_shard)
        totals = jnp.sum(per_shard, axis=-1)  # [sender, receiver] rows accepted
        self.dropped = jnp.sum(routed[me] - totals[me])  # my rows no receiver took
        self.sent, self.got = totals[me], totals[:, me]
        self.land_at = (jnp.cumsum(totals, axis=0) - totals)[me]  # where they land there
        if form == "ragged":
            self.recv_start = jnp.cumsum(self.got) - self.got
        else:
            self.recv_start = jnp.arange(ways, dtype=totals.dtype) * cap
        mine = per_shard[:, me]  # [sender, local expert]: what each sender sends me
        self.group_sizes = jnp.sum(mine, axis=0)
        rows = ways * cap
        slots = jnp.arange(rows, dtype=jnp.int32)
        # sender-major chunks: (sender, expert) segments, each sender's at its recv_start
        by_sender = (self.recv_start[:, None] + jnp.cumsum(mine, axis=1) - mine).reshape(-1)
        # expert-major groups: (expert, sender) segments, packed
        mine_t = mine.T
        by_expert = (jnp.cumsum(mine_t.reshape(-1)) - mine_t.reshape(-1)).reshape(-1)
        sizes_t, sizes_s = mine_t.reshape(-1), mine.reshape(-1)
        # grouped slot p <- arrived slot q (to regroup), arrived slot q <- grouped p (back)
        seg, off, valid = _segment(by_expert, sizes_t, slots)
        e, s = seg // ways, seg % ways
        self.to_groups = jnp.where(valid, by_sender[s * local_e + e] + off, 0)
        self.grouped_valid = valid
        seg, off, valid = _segment(by_sender, sizes_s, slots)
        s, e = seg // local_e, seg % local_e
        self.to_senders = jnp.where(valid, by_expert[e * ways + s] + off, 0)
        self.arrived_valid = valid

    def there(self, xs: jax.Array) -> jax.Array:
        """My sorted rows to their experts' devices: ``[ways * cap, D]``, grouped by local
        expert (rows past the groups zero)."""
        rows = self.ways * self.cap
        if self.form == "ragged":
            arrived = jax.lax.ragged_all_to_all(
                xs,
                jnp.zeros((rows, xs.shape[-1]), xs.dtype),
                self.send_start,
                self.sent,
                self.land_at,
                self.got,
                axis_name=EXPERT_AXIS,
            )
        else:
            shard, slot = self._slots(xs.shape[0])
            buf = jnp.zeros((self.ways, self.cap, xs.shape[-1]), xs.dtype)
            buf = buf.at[shard, slot].set(xs, mode="drop")
            arrived = jax.lax.all_to_all(buf, EXPERT_AXIS, 0, 0).reshape(rows, -1)
        return jnp.where(self.grouped_valid[:, None], arrived[self.to_groups], 0)

    def back(self, out: jax.Array, n: int) -> jax.Array:
        """The reverse of ``there``: every row home, ``[n, D]`` in its sender's sorted order
        (the dropped rows zero)."""
        arrived = jnp.where(self.arrived_valid[:, None], out[self.to_senders], 0)
        if self.form == "ragged":
            return jax.lax.ragged_all_to_all(
                arrived,
                jnp.zeros((n, out.shape[-1]), out.dtype),
                self.recv_start,
                self.got,
                self.home_at,
                self.sent,
                axis_name=EXPERT_AXIS,
            )
        home = jax.lax.all_to_all(arrived.reshape(self.ways, self.cap, -1), EXPERT_AXIS, 0, 0)
        shard, slot = self._slots(n)
        return home.at[shard, slot].get(mode="fill", fill_value=0)

    def _slots(self, n: int):
        """The padded form: each of my ``n`` sorted rows' (receiver, slot in that receiver's
        chunk); out of range when dropped."""
        r = jnp.arange(n)
        shard = jnp.searchsorted(jnp.cumsum(self.routed_sent), r, side="right")
        slot = r - self.send_start[jnp.minimum(shard, self.ways - 1)]
        return shard, slot
