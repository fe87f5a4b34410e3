"""Mesh sizes and the parameter/compute axis mappings, with their error paths."""

from __future__ import annotations

import pytest

from loomax.config import ConfigError, parse_config
from loomax.lm import TrainLmConfig
from loomax.mesh import MESH_AXES, MeshConfig, make_axis_mappings
from loomax.train import TrainerConfig


def test_minus_one_fills_the_devices():
    assert MeshConfig().resolve(8) == {
        "replica": 1,
        "data": 8,
        "expert": 1,
        "context": 1,
        "model": 1,
        "stage": 1,
    }
    assert MeshConfig(model=2).resolve(8) == {
        "replica": 1,
        "data": 4,
        "expert": 1,
        "context": 1,
        "model": 2,
        "stage": 1,
    }
    assert MeshConfig(replica=2, data=2, model=-1).resolve(8) == {
        "replica": 2,
        "data": 2,
        "expert": 1,
        "context": 1,
        "model": 2,
        "stage": 1,
    }


@pytest.mark.parametrize(
    "mesh, devices, message",
    [
        (MeshConfig(model=3), 8, "do not divide the 8 devices"),
        (MeshConfig(replica=2, data=2, model=1), 8, "needs 4 devices, but there are 8"),
    ],
)
def test_bad_sizes(mesh, devices, message):
    with pytest.raises(ValueError, match=message):
        mesh.resolve(devices)


def test_two_minus_ones_and_zero():
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        MeshConfig(data=-1, model=-1)
    with pytest.raises(ValueError, match=r"trainer.mesh.model must be positive"):
        MeshConfig(model=0)


def test_default_mappings():
    m = make_axis_mappings()
    tp = {"mlp": "model", "heads": "model", "kv_heads": "model"}
    assert m.parameter == {"embed": "data", "experts": "expert", **tp}
    assert m.compute == {"batch": ("replica", "data", "expert"), "position": "context", **tp}


def test_context_axis_splits_the_sequence():
    assert MeshConfig(data=2, context=4).resolve(8) == {
        "replica": 1,
        "data": 2,
        "expert": 1,
        "context": 4,
        "model": 1,
        "stage": 1,
    }
    assert MeshConfig(context=4).resolve(8)["data"] == 2
    assert MESH_AXES == (
        "replica",
        "data",
        "expert",
        "context",
        "model",
        "stage",
    )  # model innermost of the batch-parallel axes, then the ring; stage last
    assert "position" not in make_axis_mappings(context_axis=None).compute
    assert "position" not in make_axis_mappings().parameter
    with pytest.raises(ValueError, match=r"trainer.mesh.context must be positive"):
        MeshConfig(context=0)
    with pytest.raises(ValueError, match="'position' is mapped twice"):
        make_axis_mappings(context_axis="position", tensor_parallel_axes=["position"])


def test_context_split_checked_before_work():
    with pytest.raises(ConfigError, match=r"model.seq_len \(1000\) must be a multiple of 2 x"):
        parse_config(
            TrainLmConfig,
            None,
            args=["--model.seq_len", "1000", "--trainer.mesh.context", "16"],
        )
    config = parse_config(
        TrainLmConfig, None, args=["--model.seq_len", "1024", "--trainer.mesh.context", "4"]
    )
    assert config.trainer.mesh.context == 4 and config.model.context_parallel == "ring"
    with pytest.raises(ConfigError, match="model.context_parallel must be one of"):
        parse_config(TrainLmConfig, None, args=["--model.context_parallel", "ulysses"])


def test_expert_axis_splits_experts_and_the_batch():
    sizes = MeshConfig(data=2, expert=4).resolve(8)
    assert sizes == {"replica": 1, "data": 2, "expert": 4, "context": 1, "model": 1, "stage": 1}
    zero2 = make_axis_mappings(shard_params=False)  # experts split even with whole parameters
    assert zero2.parameter["experts"] == zero2.optimizer["experts"] == "expert"
    assert "embed" not in zero2.parameter and "experts" not in zero2.compute
    assert "experts" not in make_axis_mappings(expert_axis=None).parameter
    with pytest.raises(ValueError, match=r"trainer.mesh.expert must be positive"):
        MeshConfig(expert=0)
    with pytest.raises(ValueError, match="'experts' is mapped twice"):
        make_axis_mappings(tensor_parallel_axes=["mlp", "experts"])


def test_advanced_overrides():
    m = make_axis_mappings(
        fsdp_axis=["embed", "vocab"],
        tensor_parallel_axes=["mlp", "heads"],
        axis_resources={"kv_heads": "model"},
        parameter_axis_resources={"mlp": None, "experts": None},
    )
    assert m.parameter == {"embed": "data", "vocab": "data", "heads": "model", "kv_heads": "model"}
    assert m.compute["kv_heads"] == "model" and m.compute["mlp"] == "model"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fsdp_axis": "mlp"}, "'mlp' is mapped twice"),
        ({"batch_axis": "embed"}, "'embed' is mapped twice"),
        (
            {"compute_axis_resources": {"embed": "data"}},
            "reuses mesh axes \\['data'\\] of the batch",
        ),
        ({"axis_resources": {"embed": "tensor"}}, "unknown mesh axis 'tensor'"),
        ({"axis_resources": {"embed": ["data", "data"]}}, "uses a mesh axis twice"),
    ],
)
def test_mapping_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_axis_mappings(**kwargs)


def test_mesh_from_cli_and_errors_before_work(tmp_path):
    config = parse_config(
        TrainLmConfig, None, ["--trainer.mesh.model", "2", "--trainer.fsdp_axis", "embed"]
    )
    assert config.trainer.mesh == MeshConfig(replica=1, data=-1, model=2)
    with pytest.raises(ConfigError, match="'mlp' is mapped twice"):
        parse_config(TrainLmConfig, None, ["--trainer.fsdp_axis", "mlp"])


def test_batch_must_divide_over_data_parallel_size():
    with pytest.raises(
        ValueError, match=r"data-parallel size 3 \(trainer.mesh replica x data x expert\)"
    ):
        TrainerConfig(train_batch_size=8).microbatches(3)


def test_current_mesh_is_the_mesh_in_context_also_inside_jit():
    """``current_mesh`` (public JAX API only): the device mesh set with ``jax.set_mesh``
    outside ``jit``, its abstract mesh inside (JAX gives no devices while tracing), usable as
    ``shard_map``'s mesh either way; None without one."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh, Mesh
    from jax.sharding import PartitionSpec as P

    from loomax.mesh import current_mesh

    seen = {}

    def f(x):
        seen["inside"] = current_mesh()
        mesh = seen["inside"]
        if mesh is None:
            return x
        return jax.shard_map(lambda y: y * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)

    assert current_mesh() is None
    np.testing.assert_array_equal(jax.jit(f)(jnp.arange(4.0)), jnp.arange(4.0))
    assert seen["inside"] is None

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    with jax.set_mesh(mesh):
        assert current_mesh() is mesh
        np.testing.assert_array_equal(jax.jit(f)(jnp.arange(4.0)), 2 * jnp.arange(4.0))
    inside = seen["inside"]
    assert isinstance(inside, AbstractMesh) and inside == mesh.abstract_mesh
    assert dict(inside.shape) == {"data": 1} and inside.size == 1
    assert current_mesh() is None


def test_the_platform_is_decided_where_the_step_is_built_and_read_while_tracing(libtpu):
    """``MeshRuntime`` decides the platform once, from its mesh's devices, and its
    ``mesh_context`` hands it to the model code (``target_platform``) also inside ``jit``:
    a mesh of v5p devices (compiled for from this CPU host) makes ``auto`` attention splash
    and the kernels' interpret mode off. Outside any runtime, JAX's default backend."""
    import jax
    import jax.numpy as jnp

    from loomax.mesh import compiling_for, target_platform
    from loomax.models.attention.attention import resolve_backend
    from loomax.plan.topology import get_topology
    from loomax.runtime import MeshRuntime

    assert target_platform() == jax.default_backend() == "cpu"
    runtime = MeshRuntime(
        MeshConfig(data=4).build(get_topology("v5p:2x2x1").devices), make_axis_mappings()
    )
    assert runtime.platform == "tpu"
    seen = []
    with runtime.mesh_context():
        assert resolve_backend("auto", jnp.bfloat16, 4096, 128) == "splash"
        jax.jit(lambda x: seen.append(target_platform()) or x).trace(
            jax.ShapeDtypeStruct((4,), jnp.float32)
        )
    assert seen == ["tpu"] and target_platform() == "cpu"
    with compiling_for("gpu"):
        assert target_platform() == "gpu"
    with pytest.raises(ValueError, match="platform must be tpu, gpu or cpu, got 'cuda'"):
        with compiling_for("cuda"):
            pass


PRIVATE_JAX = {
    "_jax_compat.py": "puts back jax.core names JAX 0.11 removed, from jax._src.core",
    "jax_setup.py": "the process id before the backend starts, and whether it has: no public API",
    "distributed/jax_processes.py": "the coordination-service client: no public API",
    "plan/compile.py": "a thread's own cache setting: jax.config.update is process-wide",
    "models/attention/cudnn_packed.py": "cuDNN's packed documents: jax.nn.dot_product_attention has no offsets",
}
"""The modules of src/loomax allowed a private ``jax._src`` import, each with why (no public API)."""


def test_private_jax_only_where_no_public_api_exists():
    """``jax._src`` (private: renamed or removed by any JAX release) is imported only by the
    modules of ``PRIVATE_JAX``; the mesh in context comes from ``loomax.mesh.current_mesh``."""
    import re
    from pathlib import Path

    import loomax

    root = Path(loomax.__file__).parent
    found = {
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if re.search(r"^\s*(from|import) jax\._src\b", path.read_text(), re.MULTILINE)
    }
    assert found <= set(PRIVATE_JAX), (
        f"private jax._src imports in {sorted(found - set(PRIVATE_JAX))}"
    )
