"""One-way dependencies (STYLE 2.1): drafters <- serve.engine <- {the Ray Serve app, pipeline}.
`drafters` and the engine never import Ray (in `serve`, only `serve/app.py` does: checked by
importing every module in a fresh interpreter with `ray` made unimportable); the engine never
imports the Serve application around it, and `pipeline` imports `serve` only for the engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK_RAY = """
import importlib, sys
class _NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name} imported from a module that must not use Ray")
sys.meta_path.insert(0, _NoRay())
for mod in sys.argv[1:]:
    importlib.import_module(mod)
"""


def _modules(package: str, exclude: set[str] = frozenset()) -> list[str]:
    """Every module below ``package`` (subpackages too), dotted, less ``exclude``."""
    mods = []
    for p in sorted((ROOT / package).rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name not in exclude and name != package and parts[-1] != "__main__":
            mods.append(name)
    return mods


def test_drafters_and_serve_import_without_ray():
    mods = _modules("drafters") + _modules("serve", exclude={"serve.app"})
    proc = subprocess.run([sys.executable, "-c", BLOCK_RAY, *mods], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# package folder -> module names (and their submodules) it must never import, lazily or not
FORBIDDEN = {
    "drafters": {"serve", "pipeline", "ray"},
    "serve": {"pipeline"},
    # the engine: no Ray, and none of the Serve application around it
    "serve/engine": {"ray", "serve.app", "serve.async_engine", "serve.config", "serve.heap",
                     "serve.openai_protocol", "serve.openai_responses", "serve.vllm_app",
                     "serve.app_metrics"},
}
# package folder -> the only part of a forbidden-otherwise package it may import
ONLY = {"pipeline": {"serve": "serve.engine"}}


def _imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted absolute module) of every import in ``path``, relative imports resolved
    against the file's package (``from .x import y`` in serve/engine/a.py -> serve.engine.x, and
    ``from . import y`` -> serve.engine.y as well as serve.engine)."""
    import ast

    package = list(path.relative_to(root).parent.parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{alias.name}") for alias in node.names]
    return out


def _under(module: str, names: set[str] | str) -> bool:
    names = {names} if isinstance(names, str) else names
    return any(module == n or module.startswith(n + ".") for n in names)


def reverse_edges(root: Path = ROOT) -> list[str]:
    """Every import that breaks drafters <- serve.engine <- {Serve app, pipeline} (and Ray in
    drafters and the engine)."""
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            seen = set()
            for line, module in _imported_modules(path, root):
                hit = next((n for n in sorted(forbidden) if _under(module, n)), None)
                if hit and (line, hit) not in seen:
                    seen.add((line, hit))
                    bad.append(f"{path.relative_to(root)}:{line} imports {hit}")
    for package, allowed in ONLY.items():
        for path in sorted((root / package).rglob("*.py")):
            seen = set()
            for line, module in _imported_modules(path, root):
                for top, only in allowed.items():
                    if _under(module, top) and module != top and not _under(module, only) \
                            and line not in seen:
                        seen.add(line)
                        bad.append(f"{path.relative_to(root)}:{line} imports {module} "
                                   f"(only {only} of {top})")
    return bad


def test_imports_go_one_way_drafters_engine_app_and_pipeline():
    assert reverse_edges() == []


def test_the_boundary_check_sees_lazy_imports(tmp_path):
    """The check would have caught the reverse imports serve used to make inside functions."""
    (tmp_path / "serve").mkdir()
    (tmp_path / "drafters").mkdir()
    (tmp_path / "serve" / "app.py").write_text(
        "def build():\n    from pipeline.storage import resolve\n    return resolve\n")
    (tmp_path / "drafters" / "x.py").write_text("import torch\nimport ray.train\n")
    assert reverse_edges(tmp_path) == ["drafters/x.py:2 imports ray", "serve/app.py:2 imports pipeline"]


def test_the_boundary_check_keeps_the_engine_apart_from_the_serve_app(tmp_path):
    """The engine may not import the Serve application (relatively or not), and the pipeline
    reaches `serve` only through `serve.engine`."""
    for d in ("serve/engine", "pipeline"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "serve" / "engine" / "a.py").write_text(
        "from ..config import ServeConfig\nfrom .config import EngineConfig\n")
    (tmp_path / "serve" / "engine" / "b.py").write_text("import serve.app\n")
    (tmp_path / "pipeline" / "p.py").write_text(
        "from serve.engine.builder import build_engine\nfrom serve import app\n"
        "from serve.openai_protocol import APIError\n")
    assert reverse_edges(tmp_path) == [
        "serve/engine/a.py:1 imports serve.config",
        "serve/engine/b.py:1 imports serve.app",
        "pipeline/p.py:2 imports serve.app (only serve.engine of serve)",
        "pipeline/p.py:3 imports serve.openai_protocol (only serve.engine of serve)",
    ]
