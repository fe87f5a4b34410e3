"""Running a bench/ script's ``main`` inside a test worker (no second process importing JAX)."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_rows(script: str, args: list[str]) -> dict:
    """The JSON that ``bench/<script>``'s ``main(args + ["--json", path])`` writes."""
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = Path(tempfile.mkdtemp()) / "rows.json"
    module.main([*args, "--json", str(out)])
    return json.loads(out.read_text())
