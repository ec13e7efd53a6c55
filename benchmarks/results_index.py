"""Write ``benchmarks/results/INDEX.md``: every result of ``benchmarks/results/<benchmark>/``,
grouped by the script that made it, with its title, date and machine, and the JSON and plots
beside it.

The date and machine come from the result's JSON ``meta`` (``benchmarks/machine.py``'s fields, or
the older ``machine`` string), else from the markdown itself (its first ISO date, its
``Machine: ...`` sentence); '-' where a result recorded neither (results written before
issue 41 named no machine).

    python -m benchmarks.results_index            # rewrites the index
    python -m benchmarks.results_index --check    # exit 1 if it is out of date (CI's test)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
INDEX = RESULTS / "INDEX.md"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"Machine: ([^.`|]+)")


def _meta(json_path: Path) -> dict:
    try:
        data = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return {}
    meta = data.get("meta", data) if isinstance(data, dict) else {}
    return meta if isinstance(meta, dict) else {}


def machine_text(meta: dict, markdown: str) -> str:
    """The machine a result names: JSON meta first (structured or a string), then the markdown."""
    m = meta.get("machine")
    if isinstance(m, dict) and "cpu_capability" in m:
        from benchmarks.machine import describe

        return describe(m)
    if isinstance(m, str) and m:
        return m
    found = MACHINE.search(markdown)
    return found.group(1).strip() if found else "-"


def owner(png: Path) -> str | None:
    """The stem of the result a plot belongs to: the longest result stem in its folder that the
    plot's name is or extends with '_' (a label may extend another run's label: `x_reference`
    and `x_reference_greedy`)."""
    stems = [md.stem for md in png.parent.glob("*.md")
             if png.stem == md.stem or png.stem.startswith(md.stem + "_")]
    return max(stems, key=len, default=None)


def entry(md: Path) -> dict:
    """One row of the index for result ``md`` (``<benchmark>/<stem>.md``)."""
    text = md.read_text()
    meta = _meta(md.with_suffix(".json"))
    title = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), md.stem)
    date = meta.get("date") if isinstance(meta.get("date"), str) else None
    found = DATE.search(text)
    plots = sorted(p.name for p in md.parent.glob(f"{md.stem}*.png") if owner(p) == md.stem)
    return {"file": md.relative_to(RESULTS).as_posix(), "name": md.name,
            "script": md.parent.name, "title": title,
            "date": (date or (found.group(0) if found else "-"))[:10],
            "machine": machine_text(meta, text),
            "json": md.with_suffix(".json").name if md.with_suffix(".json").exists() else "-",
            "plots": plots}


def render(rows: list[dict]) -> str:
    lines = ["# Benchmark results: the index", "",
             "Written by `python -m benchmarks.results_index` (a test keeps it current). One folder "
             "per benchmark script; a run's files are named `<date>_<machine class>[_<label>]` "
             "(`benchmarks/machine.py`'s `result_stem`: the date it ran, torch's CPU capability "
             "with `-bf16` where bf16 is native, or the GPU; `unrecorded`: a result written "
             "before results named their machine), its plots `<same>_<plot>.png` beside it. "
             "Results measured before this layout were moved here from flat names; the "
             "commands they record name their files' new paths. "
             "What each script measures and how to run it: "
             "[`docs/benchmarks.md`](../../docs/benchmarks.md)."]
    for script in dict.fromkeys(r["script"] for r in rows):
        lines += ["", f"## {script} (`benchmarks/{script}.py`)", "",
                  "| result | title | date | machine | JSON | plots |", "|---|---|---|---|---|---|"]
        for r in sorted((r for r in rows if r["script"] == script), key=lambda r: r["name"],
                        reverse=True):  # newest first
            lines.append(f"| [`{r['name']}`]({r['file']}) | {r['title']} | {r['date']} | "
                         f"{r['machine']} | {r['json']} | {', '.join(r['plots']) or '-'} |")
    return "\n".join(lines) + "\n"


def loose_files() -> list[str]:
    """Files of ``benchmarks/results/`` outside a benchmark's folder (INDEX.md aside), or in a
    folder no script of ``benchmarks/`` is named after: results belong to a benchmark."""
    scripts = {p.stem for p in ROOT.glob("*.py")}
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")
                  if p.is_file() and p != INDEX and (p.parent == RESULTS
                                                     or p.parent.name not in scripts))


def build() -> str:
    rows = [entry(md) for md in sorted(RESULTS.glob("*/*.md"))]
    return render(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the index is stale")
    args = parser.parse_args()
    text = build()
    if args.check:
        if not INDEX.exists() or INDEX.read_text() != text:
            print(f"{INDEX} is out of date: run python -m benchmarks.results_index", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text)
    print(f"wrote {INDEX} ({len(list(RESULTS.glob('*/*.md')))} results)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
