"""The README stays true: CI runs its test command, every config field is documented in the
manual's config reference (docs/pipeline.md), and the manual stays short and linked."""

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from pipeline.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CONFIG_REFERENCE = (ROOT / "docs" / "pipeline.md").read_text()
MANUAL = ("docs/pipeline.md", "docs/drafters.md", "docs/serving.md", "docs/benchmarks.md",
          "docs/measurements.md", "benchmarks/results/INDEX.md", "SPEC.md")


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_ci_runs_the_readme_test_command():
    lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("bash infra/install.sh"))
    ci = "\n".join(lines[start:])  # the command, continuation lines included
    assert ci in _bash_blocks(README)
    assert "pytest" in ci and "install.sh" in ci and "--interop" in ci


def test_main_command_uses_the_quickstart_config():
    assert ("bash infra/install.sh && .venv/bin/python pipeline/run.py --config "
            "infra/configs/quickstart.yaml") in _bash_blocks(README)
    assert (ROOT / "infra" / "configs" / "quickstart.yaml").exists()


def _fields(model: type[BaseModel], prefix: str = ""):
    from drafters.options import DrafterOptions
    from drafters.registry import all_specs

    for name, field in model.model_fields.items():
        subs = [c for c in (field.annotation, *typing.get_args(field.annotation))
                if isinstance(c, type) and issubclass(c, BaseModel)]
        if subs and issubclass(subs[0], DrafterOptions):  # written flat: every type's keys
            yield from sorted({prefix + flat for spec in all_specs().values()
                               for flat in spec.options.flat_names().values()})
        elif subs and name not in ("convert_from_gguf", "sampling", "sources"):
            yield from _fields(subs[0], f"{prefix}{name}.")
        else:
            yield prefix + name


def test_every_config_field_is_in_the_reference():
    missing = [f for f in _fields(PipelineConfig) if f"`{f}`" not in CONFIG_REFERENCE]
    assert not missing, f"docs/pipeline.md's config reference lacks {missing}"


def test_the_readme_is_a_short_manual_that_links_every_chapter():
    """A newcomer finds the quick start and the chapters, not session-by-session histories."""
    assert len(README.splitlines()) <= 400
    for page in MANUAL:
        assert f"]({page})" in README, page
        assert (ROOT / page).is_file(), page


def test_the_results_index_lists_every_result_and_is_current():
    """benchmarks/results/INDEX.md is what `python -m benchmarks.results_index` writes now: a
    result added without re-running it fails here."""
    from benchmarks.results_index import INDEX, RESULTS, build, loose_files

    assert INDEX.read_text() == build(), "run: python -m benchmarks.results_index"
    for md in RESULTS.glob("*/*.md"):
        assert f"]({md.relative_to(RESULTS).as_posix()})" in INDEX.read_text(), md.name
    assert loose_files() == [], "results go in benchmarks/results/<benchmark>/ (result_stem)"


def test_every_relative_link_of_the_manual_resolves():
    """A link of README.md, docs/ or a result page to a file of the repository points at one that
    exists (results moved into per-benchmark folders, issue 44.6, must take their links along)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "benchmarks" / "results").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if not path or re.match(r"[a-z]+:", path):
                continue  # an anchor on the same page, or a URL
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_result_a_file_of_the_repository_names_exists():
    """Beyond links: a results path named anywhere (docs, docstrings, comments, configs) names a
    file or a run (its stem, e.g. in ``...avx2.{md,json}``) that exists."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    missing = []
    for name in files:
        path = ROOT / name
        if path.suffix not in (".md", ".py", ".yaml", ".sh", ".toml") or not path.is_file():
            continue
        for ref in re.findall(r"benchmarks/results/([\w-]+/[\w.-]+)", path.read_text()):
            ref = ref.rstrip(".")
            target = ROOT / "benchmarks" / "results" / ref
            if not (target.exists() or any(target.parent.glob(target.name + ".*"))):
                missing.append(f"{name}: {ref}")
    assert not missing, missing
