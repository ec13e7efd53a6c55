"""Small modules (STYLE): no module of the packages (drafters, serve, pipeline, infra) is longer
than 450 lines, so a reader can hold one in their head; a module that grows past it is split by
idea, not trimmed."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 450
PACKAGES = ("drafters", "serve", "pipeline", "infra")


def long_modules(root: Path = ROOT, packages=PACKAGES, limit: int = MAX_LINES) -> list[str]:
    """'path: N lines' of every .py file under ``packages`` longer than ``limit``."""
    out = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > limit:
                out.append(f"{path.relative_to(root)}: {n} lines")
    return out


def test_no_module_of_the_packages_is_longer_than_450_lines():
    assert long_modules() == []


def test_the_check_sees_a_long_module(tmp_path):
    (tmp_path / "pipeline" / "sub").mkdir(parents=True)
    (tmp_path / "pipeline" / "sub" / "big.py").write_text("x = 1\n" * 451)
    (tmp_path / "pipeline" / "ok.py").write_text("x = 1\n" * 450)
    assert long_modules(tmp_path) == ["pipeline/sub/big.py: 451 lines"]
