"""Imports at the top of the module (issue 44.5), except where a function-local import is needed:
a project module that would close an import cycle says so in a ``# lazy:`` comment on the line
above it, and a third-party package is deferred only when it is heavy to import or optional.

Why the heavy ones stay deferred: ``pipeline/run.py`` answers a bad config or ``--help`` in about
1.5 s with torch, Ray and transformers deferred and in about 5 s with them at the top (measured on
2 cores), and the suite starts such processes by the dozen; optional packages (vLLM, W&B,
DeepSpeed, matplotlib, s3fs, Ray's LLM extras) are not importable on every install.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("drafters", "serve", "pipeline", "infra")
PROJECT = {"drafters", "serve", "pipeline", "infra", "benchmarks"}
# heavy to import, or optional on some installs (see the module docstring)
DEFERRABLE = {"torch", "ray", "transformers", "pyarrow", "safetensors", "deepspeed", "wandb",
              "vllm", "matplotlib", "s3fs"}


def function_local_imports(path: Path) -> list[tuple[int, ast.AST]]:
    """(line, node) of every import inside a function body, outside ``if TYPE_CHECKING`` and
    outside a ``try`` that handles ImportError (an optional import by construction)."""
    found = []

    class Visitor(ast.NodeVisitor):
        depth = 0

        def visit_FunctionDef(self, node):
            self.depth += 1
            self.generic_visit(node)
            self.depth -= 1

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_If(self, node):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                self.generic_visit(node)

        def visit_Try(self, node):
            guards = {getattr(h.type, "id", None) for h in node.handlers}
            if not guards & {"ImportError", "ModuleNotFoundError"}:
                self.generic_visit(node)

        def visit_Import(self, node):
            if self.depth:
                found.append((node.lineno, node))

        visit_ImportFrom = visit_Import

    Visitor().visit(ast.parse(path.read_text()))
    return found


def top_package(node: ast.AST) -> str | None:
    """The imported top-level package; None for a relative import (the project's own)."""
    if isinstance(node, ast.ImportFrom):
        return None if node.level else node.module.split(".")[0]
    return node.names[0].name.split(".")[0]


def test_function_local_imports_are_cycles_or_heavy_packages():
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text().splitlines()
            for line, node in function_local_imports(path):
                top = top_package(node)
                where = f"{path.relative_to(ROOT)}:{line}: {ast.unparse(node)}"
                if top is None or top in PROJECT:
                    # the comment may head a group of consecutive lazy imports
                    k = line - 2
                    while k >= 0 and lines[k].strip().startswith(("from ", "import ")):
                        k -= 1
                    if not lines[k].strip().startswith("# lazy:"):
                        bad.append(where + " (a project module: top of the file, or a "
                                   "'# lazy: <why>' comment above it)")
                elif top in sys.stdlib_module_names:
                    bad.append(where + " (the standard library: top of the file)")
                elif top not in DEFERRABLE:
                    bad.append(where + f" ({top} is neither heavy nor optional: top of the file)")
    assert not bad, "\n".join(bad)


def test_the_placement_check_sees_a_function_local_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\n\ndef f():\n    import json\n    from . import x\n"
                   "    # lazy: cycle\n    from .y import z\n    return json, x, z\n")
    found = [ast.unparse(n) for _, n in function_local_imports(src)]
    assert found == ["import json", "from . import x", "from .y import z"]


def _top_level_project_imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports at its top level (not under TYPE_CHECKING,
    not inside a function): dotted names like ``drafters.config``."""
    tree = ast.parse(path.read_text())
    here = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    parent = here.rsplit(".", 1)[0] if path.name != "__init__.py" else here.removesuffix(".__init__")
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parent.rsplit(".", node.level - 1)[0] if node.level > 1 else parent
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" for a in node.names] + [mod]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith(package + ".")
                  and (ROOT / Path(*n.split("."))).with_suffix(".py").is_file()}
    return found


def test_the_drafters_package_has_no_import_loop():
    """Issue 44.3: the drafter config validates against the registry, the registry names the
    built-in types by module and imports them on first use, so no chain of top-level imports in
    ``drafters/`` comes back to where it started."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts): p
               for p in (ROOT / "drafters").rglob("*.py") if p.name != "__init__.py"}
    graph = {m: _top_level_project_imports(p, "drafters") & set(modules) for m, p in
             modules.items()}
    assert "drafters.registry" in graph["drafters.config"]  # validated at the top, not lazily
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
