"""Stage names are said once (pipeline/run_layout.py) and no reader builds another stage's path:
the pipeline and the benchmarks ask RunLayout (or the stage context's ``layout``) for an output."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.run_layout import STAGE_ORDER, RunLayout, link_stages
from pipeline.stages import STAGE_NAMES

ROOT = Path(__file__).resolve().parents[2]
STAGE = "|".join(STAGE_ORDER)
# a path joined from a stage's name, or a stage named by a literal where the API takes a stage
# (the benchmark sets' folder, infra/datasets/eval, is no stage)
BUILT_PATH = re.compile(rf"""(?<!"datasets" )/ *["']({STAGE})["']""")
LITERAL_STAGE = re.compile(
    rf"""(stage_dir|marker|drafter_location|publish_drafter|run_stage\(ctx,|require|drafter)\( *["']({STAGE})["']""")


def offenders(paths) -> list[str]:
    out = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if BUILT_PATH.search(line) or LITERAL_STAGE.search(line):
                out.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return out


def test_no_module_builds_a_stage_path_or_names_a_stage_by_literal():
    files = [p for d in ("pipeline", "benchmarks") for p in (ROOT / d).rglob("*.py")
             if p.name != "run_layout.py"]
    assert offenders(files) == []


def test_the_check_sees_both_kinds(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text('a = run_dir / "eval" / "report.json"\nb = ctx.stage_dir("train")\nok = "eval"\n')
    lines = [line for line in bad.read_text().splitlines()
             if BUILT_PATH.search(line) or LITERAL_STAGE.search(line)]
    assert len(lines) == 2


def test_the_stage_list_is_the_layouts_order_and_links_share_data_stages(tmp_path):
    assert STAGE_NAMES == STAGE_ORDER
    src, dest = tmp_path / "src", tmp_path / "dest"
    for stage in STAGE_ORDER[:3]:
        RunLayout(src).stage_dir(stage).mkdir(parents=True)
    RunLayout(dest).stage_dir("prompts").mkdir(parents=True)  # its own: kept
    link_stages(src, dest)
    assert not RunLayout(dest).stage_dir("prompts").is_symlink()
    assert RunLayout(dest).stage_dir("cache").resolve() == RunLayout(src).stage_dir("cache")
    assert RunLayout(dest).marker("eval") == dest / "eval" / "_SUCCESS.json"
