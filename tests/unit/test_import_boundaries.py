"""One-way dependencies (STYLE 2.1): `drafters` never imports Ray; in `serve`, only `serve/app.py`
does. Checked by importing every module in a fresh interpreter with `ray` made unimportable."""

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
    return [f"{package}.{p.stem}" for p in sorted((ROOT / package).glob("*.py"))
            if p.stem != "__init__" and p.stem not in exclude]


def test_drafters_and_serve_import_without_ray():
    mods = _modules("drafters") + _modules("serve", exclude={"app"})
    proc = subprocess.run([sys.executable, "-c", BLOCK_RAY, *mods], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# package -> packages (and top-level third-party names) it must never import, lazily or not
FORBIDDEN = {"drafters": {"serve", "pipeline", "ray"}, "serve": {"pipeline"}}


def imported_names(source: str) -> list[tuple[int, str]]:
    """(line, top-level name) of every import in a module, including imports inside functions
    (the AST sees them; a runtime check would miss a lazy import)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def reverse_edges(root: Path = ROOT) -> list[str]:
    """Every import that breaks ``drafters`` <- ``serve`` <- ``pipeline`` (and Ray in drafters)."""
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, name in imported_names(path.read_text()):
                if name in forbidden:
                    bad.append(f"{path.relative_to(root)}:{line} imports {name}")
    return bad


def test_imports_go_one_way_drafters_serve_pipeline():
    assert reverse_edges() == []


def test_the_boundary_check_sees_lazy_imports(tmp_path):
    """The check would have caught the reverse imports serve used to make inside functions."""
    (tmp_path / "serve").mkdir()
    (tmp_path / "drafters").mkdir()
    (tmp_path / "serve" / "app.py").write_text(
        "def build():\n    from pipeline.storage import resolve\n    return resolve\n")
    (tmp_path / "drafters" / "x.py").write_text("import torch\nimport ray.train\n")
    assert reverse_edges(tmp_path) == ["drafters/x.py:2 imports ray", "serve/app.py:2 imports pipeline"]
