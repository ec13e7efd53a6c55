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
