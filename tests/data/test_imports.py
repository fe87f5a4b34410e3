"""The data layer's imports: reading needs no Ray, and no module of `loomax.data` imports in a circle."""

import ast
import subprocess
import sys
from pathlib import Path

import loomax.data

DATA = Path(loomax.data.__file__).parent


def test_reading_a_token_cache_does_not_import_ray() -> None:
    code = (
        "import sys, loomax.data.token_cache.reader, loomax.data;"
        "assert 'ray' not in sys.modules, 'ray imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_building_a_token_cache_and_batching_it_import_no_jax() -> None:
    """A process that only tokenizes and batches (a `loomax cache` builder under the lease,
    the loader) starts without JAX's ~1 CPU-s of imports."""
    code = (
        "import sys, loomax.data.token_cache.build, loomax.data.token_cache.shared;"
        "import loomax.data.loader, loomax.data.growing_windows, loomax.data.windows;"
        "from loomax.distributed import RayConfig;"
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports anywhere (function bodies included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import"
            for alias in node.names:  # `from package import module` imports the module
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


def test_data_modules_import_in_one_direction() -> None:
    paths = {}
    for path in DATA.rglob("*.py"):
        parts = path.relative_to(DATA.parent.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {  # a package's own submodules (its re-exports) do not count
        name: {other for other in _imports(path, set(paths)) if not other.startswith(name + ".")}
        - {name}
        for name, path in paths.items()
    }
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, f"import circle: {' -> '.join((*trail, name))}"
        if name not in done:
            for other in sorted(graph[name]):
                visit(other, (*trail, name))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())
