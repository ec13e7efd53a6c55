"""The cProfile part tables of the benchmarks name functions that exist: a renamed engine
function once made spec_vs_target crash after an hour of measuring and engine_step_profile report
parts costing 0 ms."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT))
    spec.loader.exec_module(module)
    return module


def _defined() -> set[tuple[str, str]]:
    """(file name, function name) of every function defined in drafters/ and serve/."""
    out = set()
    for package in ("drafters", "serve"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add((path.name, node.name))
    return out


@pytest.mark.parametrize("script", ["spec_vs_target", "engine_step_profile"])
def test_every_profiled_part_names_an_existing_function(script):
    module = _load(script)
    parts = getattr(module, "STEP_PARTS", None) or module.PARTS
    named = {(suffix, func) for _, suffix, func in parts} | {module.STEP}
    missing = named - _defined()
    assert not missing, f"benchmarks/{script}.py profiles functions that do not exist: {missing}"
