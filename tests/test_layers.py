"""The import graph of ``loomax``: layers point down only, and no module imports itself back.

Every ``import`` that runs counts, including those inside functions (an import moved
into a function to dodge a circle is still a circle); ``if TYPE_CHECKING:`` blocks,
which never run, do not. The layers are those of docs/architecture.md.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

import loomax

ROOT = Path(loomax.__file__).parent

LAYERS: list[set[str]] = [
    {"errors", "lazy_exports"},
    {"config_help", "config_suggest", "config_parse_cache"},
    {
        "config",
        "storage",
        "atomic_files",
        "jax_setup",
        "_xla_flags",
        "_jax_compat",
        "peak_flops",
        "batch_schedule",
        "trace_frames",
    },
    {"cli_parser", "row_blocks"},
    {"mesh", "tree_paths", "stages", "mesh_fit", "pipeline_schedules"},
    {"distributed", "runtime", "tracking"},
    {"models", "optim", "data", "checkpoint"},
    {"hf", "downstream"},
    {"train"},
    {"hooks"},
    {"callbacks"},
    {"lm"},
    {"train_lm", "inference", "dpo", "rl"},
    {"benchmark"},
    {"ladder", "plan", "launch", "model_cli", "config_reference"},
    {"cli"},
]
"""Top-level modules and packages of ``loomax``, lowest layer first. A unit may import
its own package and units of lower layers, nothing at its own layer or above."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(modules: dict[str, Path], type_checking: bool = False) -> dict[str, set[str]]:
    """For every module, the ``loomax`` modules it imports (resolved to existing modules);
    with ``type_checking``, also those imported only for type checkers."""

    def resolve(name: str) -> str | None:
        while name not in modules:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree) if type_checking else _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith("loomax.") else None
                if found and found != name and not name.startswith(found + "."):
                    edges[name].add(found)  # a package's __init__ is not an import back
    return edges


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(test):
            continue
        yield node
        yield from _runtime_nodes(node)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()} - {""}
    placed = set().union(*LAYERS)
    assert units <= placed, f"give these a layer in LAYERS: {sorted(units - placed)}"


def test_imports_point_down_the_layers():
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    wrong = sorted(
        f"{a} -> {b}"
        for a, targets in _imports(_modules()).items()
        for b in targets
        if _unit(a) and _unit(a) != _unit(b) and layer[_unit(b)] >= layer[_unit(a)]
    )
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


@pytest.mark.parametrize("type_checking", [False, True], ids=["runtime", "with-type-checking"])
def test_no_import_cycles(type_checking):
    """No circle, not even one closed only by an ``if TYPE_CHECKING:`` import (a sign of two
    modules that each need the other)."""
    edges = _imports(_modules(), type_checking)
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in list(edges):
        if module not in index:
            visit(module)
    assert not cycles, f"modules that import each other: {cycles}"


def test_no_module_is_over_400_lines():
    """The layout's limit (docs/architecture.md): a module that grows past 400 lines is split
    by job, not left to grow."""
    from pathlib import Path

    import loomax

    root = Path(loomax.__file__).parent
    long = {
        str(p.relative_to(root)): n
        for p in root.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long
