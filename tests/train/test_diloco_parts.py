"""DiLoCo's parts that need no mesh: its config, sync schedule, fragments, the HLO reader."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from loomax.config import ConfigError
from loomax.models import Gpt2Config
from loomax.train import TrainerConfig
from loomax.train.collectives import collectives, crosses
from loomax.train.diloco import WORKERS, DiLoCoConfig
from loomax.train.fragments import nodes, plan_fragments


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"inner_steps": 0}, "inner_steps"),
        ({"outer_learning_rate": 0.0}, "outer_learning_rate"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"inner_steps": 6, "fragments": 4}, "fragments"),
    ],
)
def test_bad_settings_name_their_key(settings, key):
    with pytest.raises(ValueError, match=f"trainer.diloco.{key}"):
        DiLoCoConfig(**settings)


def test_fragments_sync_in_turn_evenly_staggered():
    plain = DiLoCoConfig(inner_steps=3)
    assert [plain.synced_at(s) for s in range(1, 7)] == [None, None, 0, None, None, 0]
    streaming = DiLoCoConfig(inner_steps=6, fragments=3)
    synced = [streaming.synced_at(s) for s in range(1, 13)]
    assert synced == [None, 0, None, 1, None, 2] * 2  # each fragment every 6 steps


def test_workers_rest_on_replica_and_nothing_else_may():
    mappings = TrainerConfig(diloco=DiLoCoConfig()).axis_mappings()
    assert mappings.parameter[WORKERS] == "replica" and mappings.optimizer[WORKERS] == "replica"
    assert WORKERS not in TrainerConfig().axis_mappings().parameter
    with pytest.raises(ValueError, match="trainer.diloco: the parameter mapping sends 'vocab'"):
        TrainerConfig(diloco=DiLoCoConfig(), parameter_axis_resources={"vocab": "replica"})


@pytest.fixture(scope="module")
def params():
    model = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=4, num_heads=2)
    return jax.eval_shape(lambda: model.build(64, key=jax.random.PRNGKey(0)))


def test_fragments_are_contiguous_layers_and_balanced(params):
    leaves = nodes(params)
    sizes = [int(np.prod(n.array.shape)) for n in leaves]
    one = plan_fragments(params, 1)
    assert len(one) == 1 and all(p.stop is None for p in one[0]) and len(one[0]) == len(leaves)
    two = plan_fragments(params, 2)
    layered = {p.leaf for f in two for p in f if p.stop is not None}
    assert layered and all(
        {(p.start, p.stop) for p in f if p.stop is not None} == {(2 * i, 2 * i + 2)}
        for i, f in enumerate(two)
    )  # layers 0-1, then 2-3
    covered = sorted((p.leaf, p.start) for f in two for p in f)
    assert len(covered) == len(set(covered))  # nothing twice
    assert {leaf for leaf, _ in covered} == set(range(len(leaves)))  # everything once
    loads = [sum(sizes[p.leaf] * ((p.stop - p.start) / 4 if p.stop else 1) for p in f) for f in two]
    assert max(loads) / min(loads) < 1.5


def test_more_fragments_than_pieces_is_refused(params):
    with pytest.raises(ConfigError, match="trainer.diloco.fragments: 40 fragments"):
        plan_fragments(params, 40)


HLO = """
  %all-reduce.1 = f32[64,8]{1,0} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %all-gather.2 = f32[1,32]{0,1} all-gather(%y), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={1}
  %ar = (f32[4]{0}, bf16[2,2]{1,0}) all-reduce(%a, %b), replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, to_apply=%add
  %cp = f32[8]{0} collective-permute(%z), source_target_pairs={{0,4},{4,0}}
  %not = f32[8]{0} add(%a, %b)
"""


def test_collectives_are_read_with_their_bytes_and_groups():
    found = collectives(HLO)
    assert [c.op for c in found] == [
        "all-reduce",
        "all-gather",
        "all-reduce",
        "collective-permute",
    ]
    assert [c.bytes for c in found] == [64 * 8 * 4, 32 * 4, 4 * 4 + 4 * 2, 8 * 4]
    assert found[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert found[1].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert found[2].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    mesh = SimpleNamespace(devices=np.empty((2, 4, 1)), axis_names=("replica", "data", "model"))
    assert [crosses(c, mesh, "replica") for c in found] == [False, True, False, True]
    assert [crosses(c, mesh, "data") for c in found] == [True, False, True, False]


def test_hooks_that_compute_inside_the_step_are_refused_before_any_compile(tiny, tmp_path):
    from loomax.train import JitHook

    trainer = tiny.trainer(tmp_path, diloco=DiLoCoConfig(inner_steps=2))
    trainer.add_hook(JitHook(lambda context: {"x": context.loss}))
    with pytest.raises(ConfigError, match="trainer.diloco: hooks that compute inside the step"):
        tiny.init(trainer)


def test_inside_a_worker_the_batch_is_split_over_data_only():
    from loomax.train.diloco import worker_compute_mapping

    compute = TrainerConfig().axis_mappings().compute
    inner = worker_compute_mapping(compute, "batch")
    assert inner["batch"] == ("data", "expert") and inner["mlp"] == "model"
    assert "batch" not in worker_compute_mapping({"batch": "replica"}, "batch")
    with pytest.raises(ValueError, match="the compute mapping sends 'position' to replica"):
        TrainerConfig(
            diloco=DiLoCoConfig(), compute_axis_resources={"batch": "data", "position": "replica"}
        )


def test_workers_copies_and_any_optax_outer_optimizer(params):
    import optax

    from loomax.train.diloco import DiLoCo

    trained = jax.tree.map(lambda x: x, params)  # shapes: init is traced, nothing allocated
    diloco = DiLoCo(DiLoCoConfig(fragments=2), optax.sgd(0.1), 3, outer=optax.adam(1e-3))
    state = jax.eval_shape(diloco.init, trained)
    assert all(n.axes[0].name == WORKERS and n.axes[0].size == 3 for n in nodes(state.workers))
    assert len(state.outer) == 2 and all(
        isinstance(s[0], optax.ScaleByAdamState) for s in state.outer
    )
    default = jax.eval_shape(DiLoCo(DiLoCoConfig(), optax.sgd(0.1), 3).init, trained)
    assert isinstance(default.outer[0][0], optax.TraceState)  # Nesterov momentum
