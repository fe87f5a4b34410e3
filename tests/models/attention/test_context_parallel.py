"""Context parallelism on 8 fake CPU devices (a fresh process: the device count is fixed when
JAX starts): ring and all-gather attention against one device, values and gradients."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models.attention.sequence_layout import check_split, zigzag_order

WORKER = Path(__file__).with_name("context_parallel_run.py")
TOLERANCE = 1e-5
"""Split attention sums the same terms in another order (per ring step, then combined)."""


@pytest.fixture(scope="module")
def runs(json_worker):
    """Every mode of the worker in one process on 8 fake devices (JAX starts once)."""
    return json_worker(WORKER, "attention", "memory", "train", "bench")


@pytest.fixture(scope="module")
def attention_runs(runs):
    return runs["attention"]


@pytest.mark.parametrize(
    "variant", ["ring", "all_gather", "ring_tensor_parallel", "ring_padded", "ring_overlapped"]
)
def test_split_attention_equals_one_device(attention_runs, variant):
    """Causal + document masks (documents crossing the shards) + grouped-query heads, data 2 x
    context 4 (or context 4 x model 2, the heads split too; or blocks of 3, each chunk's last
    block padded; or the ring as a TPU or GPU program runs it, overlapped: hops packed into
    one buffer, dK/dV partial sums a hop behind their block): output, dQ, dK and dV equal
    the unsplit attention's."""
    errors = attention_runs[variant]["errors"]
    assert set(errors) == {"out", "dq", "dk", "dv"}
    for name, error in errors.items():
        assert error < TOLERANCE, (variant, name, error)


def test_ring_never_gathers_keys_and_values(attention_runs):
    """The ring passes blocks (collective-permutes), forward and backward: no all-gather in the
    compiled gradient program; the all-gather variant has them (so the count can fail)."""
    assert attention_runs["ring"]["all_gathers"] == 0
    assert attention_runs["ring_tensor_parallel"]["all_gathers"] == 0
    assert attention_runs["ring"]["collective_permutes"] > 0
    assert attention_runs["all_gather"]["all_gathers"] > 0


def test_ring_count_is_the_causal_work(attention_runs):
    """The plan's static count (``count_step``: a cond costs its dearer branch) of the ring's
    forward + backward is the causal work plus the hidden halves of the diagonal blocks
    (each device's two diagonal chunk pairs of m = 2 blocks: 1 + 1 / (2 n m) = 17/16 at
    context n = 4). When every hop ran every block pair behind a run-time cond, it was the
    full square, 2x; with the chunk pairs static but the diagonals' block pairs behind the
    cond, 9/8."""
    counts = attention_runs["counts"]
    assert counts["ring"] == pytest.approx(counts["causal"] * 17 / 16, rel=1e-9), counts


def test_saving_ring_residuals_spares_the_forward_rerun(attention_runs):
    """Under layer remat the backward runs the ring forward again (its two matmuls a block
    pair: 2/7 more), unless the policy saves ``ring_residuals`` (``model.remat_save``): then
    the count is the unremat'd one."""
    counts = attention_runs["counts"]
    assert counts["ring_remat_saved"] == counts["ring"], counts
    assert counts["ring_remat"] == pytest.approx(counts["ring"] * 9 / 7, rel=1e-9), counts


@pytest.fixture(scope="module")
def memory_runs(runs):
    return runs["memory"]


def test_ring_attention_memory_per_device_falls_with_context(memory_runs):
    """Compiled forward + backward of one attention (1,024 positions, compile only, byte
    counts): context 4 with the ring holds under 1/3.6 of one device's total (inputs,
    gradients, temporaries) and its temporaries under 1/3.3 (3.73x and 3.54x measured).
    Before the backward updated its dQ/dK/dV in place and its zero dQ waited for the
    forward's result, the ring held 1/3.2 and 1/2.8 (docs/sharding.md, "Memory per device")."""
    one, ring = memory_runs["one_device"], memory_runs["ring"]
    assert one["total"] / ring["total"] > 3.6, (one, ring)
    assert one["temp"] / ring["temp"] > 3.3, (one, ring)
    gathered = memory_runs["all_gather"]
    assert ring["temp"] < gathered["temp"], (ring, gathered)


def test_ring_blocks_are_at_most_ring_block(memory_runs):
    """Asked for blocks of 256 at 2,048 positions (context 4: zig-zag chunks of 256), the
    blockwise ring compiles to the program of blocks of 128 (``RING_BLOCK``), byte for byte:
    its score tiles are the one term of its working set that does not shrink with the
    context axis. Uncapped, its temporaries were 3.6x those at 128 (7.3 MB against 2.0)."""
    assert memory_runs["ring_block_256"] == memory_runs["ring_block_128"]


def test_bench_trains_with_context_8_at_small_size(runs):
    """bench/context_parallel.py (its 65,536-position run is in bench/README.md) at 256
    positions: a tiny Llama's gradient step (one layer of width 32, one timed step and no
    warm-up: the compile is most of the time) runs with the sequence split 8 ways by each
    variant and unsplit, and the split attention holds less per device. Its ``main`` runs in
    the worker (8 fake devices, as the script's own)."""
    rows = {row["case"]: row for row in runs["bench"]["rows"]}
    assert set(rows) == {"no split", "ring", "all_gather"}
    assert all(row["step_tokens_per_s"] > 0 for row in rows.values())
    assert rows["ring"]["context"] == 8 and rows["no split"]["context"] == 1
    for split in ("ring", "all_gather"):
        assert rows[split]["attention_total_mib"] < rows["no split"]["attention_total_mib"] / 2


def test_zigzag_layout():
    assert zigzag_order(16, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(zigzag_order(48, 4)) == list(range(48))
    assert np.array_equal(zigzag_order(8, 1), np.arange(8))
    with pytest.raises(ConfigError, match=r"model.seq_len \(20\) must be a multiple of 2 x"):
        check_split(20, 4)


@pytest.fixture(scope="module")
def train_runs(runs):
    return runs["train"]


def test_split_training_gives_the_losses_of_one_device(train_runs):
    """4 steps of a tiny grouped-query Llama with document masks at 256 positions, then an
    evaluation of the final weights: data 2 x context 4 (zig-zag tokens, rotary positions,
    documents, targets; the fused loss) against one device. The ring only: the attention
    tests above hold both variants to one device, values and gradients."""
    assert len(train_runs["one_device"]) == 5  # 4 training losses, the eval loss
    np.testing.assert_allclose(train_runs["ring"], train_runs["one_device"], rtol=TOLERANCE)


def test_split_loss_gradients_and_logits_equal_one_device(train_runs):
    """Every parameter's gradient of a tiny GPT-2 (its learned positions taken in the layout;
    Adam would hide a uniform scale error in the Llama's losses), and its logits, put back in
    the tokens' order."""
    assert train_runs["gradient_error"] < TOLERANCE


def test_split_document_positions_equal_one_device(train_runs):
    """The same with ``model.document_positions``: each document's positions (from 0) worked
    out in true order and taken into the zig-zag layout, where documents cross the shards."""
    assert train_runs["document_positions_gradient_error"] < TOLERANCE


def test_loss_over_rows_split_by_data_runs_on_each_devices_own_rows(train_runs):
    """With the rows split over `data` alone the fused loss runs per device too. In the global
    view its scan over token blocks made every device walk every block: XLA:CPU all-gathered
    the whole batch's hidden states to each device, and the v5p program of
    config/mixtral_8x7b.yaml all-reduced a [1024, 2048, 4096] buffer at every block."""
    assert train_runs["data4_gradient_error"] < TOLERANCE
    # no collective as large as the whole batch's hidden states: the largest left is a gradient
    assert train_runs["data4_largest_collective"] < train_runs["hidden_elements"]


def test_sliding_window_with_a_split_sequence_is_refused_up_front():
    """Context-parallel attention is full causal: a sliding window there is a ConfigError
    naming both keys, raised when the run's config is made (before any work)."""
    from loomax.lm import TrainLmConfig
    from loomax.mesh import MeshConfig
    from loomax.models.families.mistral import MistralConfig
    from loomax.train import TrainerConfig

    model = MistralConfig(seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=1,
                          num_heads=2, sliding_window=6)  # fmt: skip
    TrainLmConfig(model=model, trainer=TrainerConfig(mesh=MeshConfig(context=1)))
    with pytest.raises(ConfigError, match=r"model.sliding_window \(6\) .*trainer.mesh.context"):
        TrainLmConfig(model=model, trainer=TrainerConfig(mesh=MeshConfig(context=2)))


RING_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][a-z0-9\-]*)\((.*)$")
RING_HLO_CALLS = re.compile(
    r"(?:calls|to_apply|body|condition)=%([\w.\-]+)|branch_computations=\{([^}]*)\}"
)


def _scheduled_computations(hlo: str) -> dict[str, list[tuple[str, str, str]]]:
    """A compiled (scheduled) HLO module's computations: ``(name, opcode, rest)`` of each
    instruction, in the order the schedule runs them."""
    computations: dict[str, list] = {}
    current = None
    for line in hlo.splitlines():
        if not line.startswith((" ", "}")) and line.endswith("{"):
            current = computations.setdefault(line.removeprefix("ENTRY ").split()[0][1:], [])
        elif line == "}":  # (a kernel's backend config spans lines that start with "}")
            current = None
        elif current is not None and (found := RING_HLO_INSTRUCTION.match(line)):
            current.append(found.groups())
    return computations


def _work(op: str, rest: str) -> bool:
    """Whether an instruction is a matmul (convolution, dot) or a Mosaic kernel (splash)."""
    return op in ("convolution", "dot") or 'custom_call_target="tpu_custom_call"' in rest


def _matmuls(computations, name: str, rest: str, seen: dict) -> int:
    """Matmuls and kernels an instruction runs, in the computations it calls."""
    called = [
        c.strip().lstrip("%") for m in RING_HLO_CALLS.findall(rest) for c in ",".join(m).split(",")
    ]
    total = 0
    for comp in called:
        if comp not in seen:
            seen[comp] = 0
            seen[comp] = sum(
                _work(op, r) + _matmuls(computations, n, r, seen)
                for n, op, r in computations.get(comp, [])
            )
        total += seen[comp]
    return total


def ring_hops_overlap(hlo: str) -> list[tuple[str, int]]:
    """Each collective-permute of a scheduled program, with the matmuls the schedule runs
    between its start and its done (an instruction's own, or in what it calls: the
    attention's loops and conds)."""
    computations, seen, hops = _scheduled_computations(hlo), {}, []
    for instructions in computations.values():
        for i, (name, op, _) in enumerate(instructions):
            if op != "collective-permute-start":
                continue
            done = next(
                j for j in range(i + 1, len(instructions))
                if instructions[j][1] == "collective-permute-done"
                and re.match(rf"%{re.escape(name)}\)", instructions[j][2])
            )  # fmt: skip
            between = instructions[i + 1 : done]
            work = sum(_work(op2, r) + _matmuls(computations, n, r, seen) for n, op2, r in between)
            hops.append((name, work))
    return hops


@pytest.mark.usefixtures("libtpu")
@pytest.mark.parametrize("backend,hops", [("blockwise", 5), ("splash", 6)])
def test_ring_hops_overlap_attention_in_the_v5p_program(backend, hops):
    """The ring's forward + backward compiled for v5p (compile only; context 4, 8,192
    positions, bf16, 4 query / 2 KV heads of 128), blockwise or splash per chunk pair: every
    collective-permute of the scheduled program has attention (matmuls, or splash's
    kernels) between its start and its done. The hops: the forward's own chunks and its
    in-loop hop; the backward's own chunks (blockwise: merged by XLA with the forward's),
    its in-loop hop, its last hop and the partial sums' trip home. Receiving a block and
    then computing on it, the v5p programs had 24 (blockwise) and 22 (splash)
    collective-permutes, all but 2 or 3 with nothing between start and done. (8,192 is the
    shortest sequence at which XLA's scheduler overlaps every hop: at 4,096 one hop of each
    program has nothing between start and done. 16,384 compiled in 20 and 22 CPU-s against
    17.7 and 17.0 here, AMD EPYC, loaded. No cheaper program keeps the check: the compile
    does not fall with the heads (2 query / 1 KV head: the blockwise forward's own-chunk
    hop then overlaps nothing), context 2 at 4,096 (3 hops, one bare) compiles in 8.6 CPU-s
    but is another program, and below XLA's default execution-time effort (-0.5, -1) libtpu
    schedules no hop under work at all; the two backends are two programs, compiled once
    each.)"""
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from loomax.mesh import MeshConfig, make_axis_mappings
    from loomax.models.attention.attention import causal_attention
    from loomax.models.axes import Batch, Heads, HeadSize, KeyPosition, KvHeads, Position
    from loomax.plan.topology import get_topology
    from loomax.runtime import MeshRuntime

    devices = get_topology("v5p:2x2x1").devices
    mesh = MeshConfig(data=1, context=4).build(devices[:4])
    split = NamedSharding(mesh, P(None, "context"))
    seq = 8192
    q = jax.ShapeDtypeStruct((1, seq, 4, 128), jnp.bfloat16, sharding=split)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 128), jnp.bfloat16, sharding=split)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=split)

    def loss(q, k, v, w, seg):
        out = causal_attention(
            hax.named(q, (Batch, Position, Heads, HeadSize)),
            hax.named(k, (Batch, KeyPosition, KvHeads, HeadSize)),
            hax.named(v, (Batch, KeyPosition, KvHeads, HeadSize)),
            backend=backend, segment_ids=hax.named(seg, (Batch, Position)),
            context_parallel="ring", flash_block=128,
        )  # fmt: skip
        return (out.array.astype(jnp.float32) * w).sum()

    with MeshRuntime(mesh, make_axis_mappings()).mesh_context():
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        hlo = step.lower(q, kv, kv, q, seg).compile().as_text()
    overlaps = ring_hops_overlap(hlo)
    assert all(work > 0 for _, work in overlaps), overlaps
    assert len(overlaps) == hops, overlaps
