"""benchmarks/drafter_quality.py's report: the table it builds from each contender's eval report,
and the markdown naming the plots it wrote beside it."""

from __future__ import annotations

import pytest


def contender(tau: float, rates: list, calibrated: bool = False, per_prompt=None) -> dict:
    cell = {"tau": tau, "draft_ms_per_round": 10.0, "verify_ms_per_round": 40.0,
            "conditional_acceptance": rates, "rounds": 100,
            **({"per_prompt": per_prompt} if per_prompt else {})}
    return {"report": {"results": {"gsm8k": {"1.0": cell}, "mt-bench": {"1.0": cell}},
                       "domains": {"1.0": {"math": tau, "chat": tau, "macro": tau}},
                       "trainable_parameters": 12_900_000},
            "train": {"steps": 600, "final_metrics": {"loss": 2.0, "heldout_tau": tau}},
            "calibration": {"calibrated": calibrated, "reason": "identity kept"}}


def test_table_and_markdown_name_the_suffixed_plots():
    from benchmarks.drafter_quality import build_table, render_md

    results = {"dspark": contender(2.0, [0.5, 0.4, None]), "eagle3": contender(1.6, [0.4, None, None])}
    table = build_table(results, "1.0")
    assert table["dspark"]["domains"]["macro"] == 2.0
    assert table["eagle3"]["conditional_acceptance"] == [0.4, None, None]
    meta = {"target": "t", "dtype": "bfloat16", "gamma": 3, "temperature": "1.0",
            "prompts_per_dataset": 8, "max_new_tokens": 64, "train_steps": 600,
            "global_batch_size": 16, "machine": "m", "wall_minutes": 1.0, "command": "c",
            "files": {"conditional_acceptance": "2026-12-07_avx2_ref_conditional_acceptance.png",
                      "tau": "2026-12-07_avx2_ref_tau.png",
                      "reliability": "2026-12-07_avx2_ref_dspark_reliability.png"}}
    md = render_md(table, results, meta)
    assert "`2026-12-07_avx2_ref_conditional_acceptance.png`" in md
    assert "| dspark / eagle3 | 1.250 | 1.250 | 1.250 |" in md
    assert "| eagle3 | 0.400 | - | - |" in md  # positions no round reached are not drawn as 0
    assert "Not calibrated: identity kept" in md



def test_the_reliability_diagram_is_named_only_when_one_was_written():
    """A first contender reused from an earlier run (--results-from) brings no reliability plot:
    the report then names none instead of a file that does not exist."""
    from benchmarks.drafter_quality import build_table, render_md

    dspark = contender(2.0, [0.5, 0.4, None])
    dspark["calibration"] = {
        "calibrated": True, "fit_rounds": 10, "report_rounds": 9, "temperatures": [1.0],
        "mean_ece_before": 0.02, "mean_ece_after": 0.01,
        "report": {"positions": [{"position": 1, "positive_rate": 0.3, "ece_before": 0.02,
                                  "ece_after": 0.01, "auroc_before": 0.7, "brier_before": 0.2,
                                  "brier_after": 0.2}]}}
    results = {"dspark": dspark}
    meta = {"target": "t", "dtype": "bfloat16", "gamma": 3, "temperature": "1.0",
            "prompts_per_dataset": 8, "max_new_tokens": 64, "train_steps": 600,
            "global_batch_size": 16, "machine": "m", "wall_minutes": 1.0, "command": "c",
            "files": {"conditional_acceptance": "a.png", "tau": "t.png",
                      "reliability": "r_dspark_reliability.png"}}
    assert "reliability diagram: `r_dspark_reliability.png`" in render_md(
        build_table(results, "1.0"), results, meta)
    meta["files"]["reliability"] = None
    md = render_md(build_table(results, "1.0"), results, meta)
    assert "reliability diagram" not in md and "(9 rounds)." in md

def finished_stage(run_dir, name):
    (run_dir / name).mkdir(parents=True)
    (run_dir / name / "_SUCCESS.json").write_text("{}")


def test_trained_from_links_data_and_drafter_stages_but_keeps_its_own(tmp_path):
    """--trained-from: every stage up to calibrate comes from the earlier run, so only eval runs
    again; a stage the new run already has stays; an unfinished contender is named."""
    from benchmarks.drafter_quality import (MODEL_STAGES, SHARED_STAGES, missing_trained_stages,
                                            link_stages)

    earlier = tmp_path / "earlier"
    for stage in SHARED_STAGES + MODEL_STAGES:
        finished_stage(earlier / "dspark", stage)
    finished_stage(earlier / "eagle3", "train")  # its calibrate stage never finished
    assert missing_trained_stages(earlier, ["dspark"]) == []
    assert missing_trained_stages(earlier, ["dspark", "eagle3"]) == ["eagle3/calibrate"]

    new = tmp_path / "greedy" / "dspark"
    finished_stage(new, "eval")
    link_stages(earlier / "dspark", new, SHARED_STAGES + MODEL_STAGES)
    for stage in SHARED_STAGES + MODEL_STAGES:
        assert (new / stage).is_symlink() and (new / stage / "_SUCCESS.json").exists()
    assert not (new / "eval").is_symlink()
    link_stages(earlier / "dspark", new, SHARED_STAGES + MODEL_STAGES)  # again: no error


def test_trained_from_refuses_the_runs_own_directory(tmp_path, monkeypatch, capsys):
    """Evaluating into the directory the drafters were trained in would overwrite its eval
    results and config.yaml: refused before any work."""
    import sys
    from pathlib import Path

    from benchmarks import drafter_quality

    config = Path(__file__).resolve().parents[2] / "infra" / "configs" / "drafter_quality.yaml"
    run_dir = tmp_path / "dq"
    for stage in drafter_quality.MODEL_STAGES:
        finished_stage(run_dir / "dspark", stage)
    monkeypatch.setattr(sys, "argv", ["drafter_quality.py", "--config", str(config),
                                      "--contenders", "dspark", "--set", f"run_dir={run_dir}",
                                      "--trained-from", str(run_dir)])
    assert drafter_quality.main() == 2
    assert "own directory" in capsys.readouterr().err
    assert not (run_dir / "dspark" / "config.yaml").exists()


def test_a_contender_that_drafted_in_no_round_of_a_domain_reads_unmeasured():
    """An eval cell with no drafted round has tau None and its domain is missing from that
    contender's means (pipeline.evaluate.domain_summary): the report prints "-" there, keeps the
    domain's column from the other contender, and prints no ratio against it."""
    from benchmarks.drafter_quality import build_table, render_md

    eagle3 = contender(1.6, [0.4])
    cell = dict(eagle3["report"]["results"]["mt-bench"]["1.0"], tau=None, rounds=0,
                draft_ms_per_round=None, verify_ms_per_round=None)
    eagle3["report"]["results"]["mt-bench"] = {"1.0": cell}
    eagle3["report"]["domains"]["1.0"] = {"math": 1.6, "macro": 1.6}
    results = {"dspark": contender(2.0, [0.5]), "eagle3": eagle3}
    meta = {"target": "t", "dtype": "float32", "gamma": 1, "temperature": "1.0",
            "prompts_per_dataset": 8, "max_new_tokens": 64, "train_steps": 600,
            "global_batch_size": 16, "machine": "m", "wall_minutes": 1.0, "command": "c",
            "files": {"conditional_acceptance": "c.png"}}
    md = render_md(build_table(results, "1.0"), results, meta)
    assert "| eagle3 | 1.600 | - | 1.600 | - | 1.600 |" in md  # gsm8k, mt-bench, math, chat
    assert "| dspark / eagle3 | 1.250 | - | 1.250 |" in md
    assert build_table(results, "1.0")["eagle3"]["draft_ms_per_round"] == 10.0  # gsm8k's alone


def test_paired_comparison_says_whether_the_difference_separates():
    """drafter_quality's comparison table: the macro difference of the first contender against
    each other one with its paired 95 % interval, and "separates" only where it excludes 0."""
    from benchmarks.drafter_quality import build_table, comparisons, render_md

    spread = [[20 + 7 * i, 10] for i in range(8)]  # prompt taus 2.0 .. 6.9
    results = {"dspark": contender(2.0, [0.5], per_prompt=spread),
               "eagle3": contender(1.6, [0.4], per_prompt=[[c - 2, r] for c, r in spread]),
               "dflash": contender(1.6, [0.4], per_prompt=spread)}
    pairs = comparisons(results, "1.0")
    assert pairs["dspark / eagle3"]["separates"] and not pairs["dspark / dflash"]["separates"]
    assert pairs["dspark / eagle3"]["difference"] == pytest.approx(0.2)
    meta = {"target": "t", "dtype": "bfloat16", "gamma": 1, "temperature": "1.0",
            "prompts_per_dataset": 8, "max_new_tokens": 64, "train_steps": 600,
            "global_batch_size": 16, "machine": "m", "wall_minutes": 1.0, "command": "c",
            "comparisons": pairs, "files": {"conditional_acceptance": "c.png"}}
    md = render_md(build_table(results, "1.0"), results, meta)
    assert "| dspark / eagle3 | 0.200 [0.200, 0.200] |" in md and "| yes |" in md
    assert "| dspark / dflash | 0.000 [0.000, 0.000] |" in md and "| no |" in md
    # a report from before intervals: no per-prompt counts, no paired table (nothing invented)
    assert comparisons({"dspark": contender(2.0, [0.5]), "eagle3": contender(1.6, [0.4])},
                       "1.0") == {}


@pytest.mark.parametrize("config", ["infra/configs/drafter_quality.yaml",
                                    "infra/configs/smollm2_reference.yaml"])
def test_every_contender_is_a_valid_config_of_its_own_type(config):
    """A contender whose overrides do not make a valid drafter (e.g. DSpark's heads left on a
    DFlash) would fail only after the earlier contenders trained for an hour."""
    from benchmarks.drafter_quality import CONTENDERS, contender_config

    for name in CONTENDERS:
        cfg = contender_config(config, name, [])
        assert cfg.run_dir.endswith(name)
        assert cfg.drafter.drafter_type == name.split("-")[0]
    assert contender_config(config, "dspark-anchor_features", []).drafter.anchor_features
    assert contender_config(config, "dflash-layers_5", []).drafter.num_hidden_layers == 5
    assert contender_config(config, "eagle3-block_15", []).drafter.block_size == 15


def run_main(monkeypatch, *args) -> int:
    import sys
    from pathlib import Path

    from benchmarks import drafter_quality

    config = Path(__file__).resolve().parents[2] / "infra" / "configs" / "drafter_quality.yaml"
    monkeypatch.setattr(sys, "argv", ["drafter_quality.py", "--config", str(config), *args])
    return drafter_quality.main()


def earlier_results(tmp_path, settings: dict):
    import json

    spread = [[20 + 7 * i, 10] for i in range(8)]
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"meta": {"settings": settings}, "contenders": {
        "dspark": contender(2.0, [0.5], per_prompt=spread),
        "eagle3": contender(1.6, [0.4], per_prompt=[[c - 2, r] for c, r in spread])}}))
    return path


def test_results_from_pairs_contenders_of_an_earlier_run_without_running_them(tmp_path,
                                                                              monkeypatch):
    """--results-from: contenders an earlier results JSON holds are taken from it (nothing is
    trained or evaluated: no run directory appears), and the new files pair them and keep their
    reports, so a later run can take them back again."""
    import json
    from pathlib import Path

    from benchmarks.drafter_quality import eval_settings
    from pipeline.config import load_config

    config = Path(__file__).resolve().parents[2] / "infra" / "configs" / "drafter_quality.yaml"
    run_dir = tmp_path / "dq"
    cfg = load_config(str(config), [f"run_dir={run_dir}"])
    earlier = earlier_results(tmp_path, eval_settings(cfg))
    out = tmp_path / "out" / "run_x"  # the files' path without a suffix
    assert run_main(monkeypatch, "--contenders", "dspark,eagle3", "--set", f"run_dir={run_dir}",
                    "--results-from", str(earlier), "--out", str(out), "--suffix", "_x") == 0
    assert not run_dir.exists()
    md = (out.parent / "run_x.md").read_text()
    assert "Taken from an earlier run" in md and "Partial" not in md
    assert "| dspark / eagle3 | 0.200 [0.200, 0.200] |" in md
    written = json.loads((out.parent / "run_x.json").read_text())
    assert sorted(p.name for p in out.parent.glob("*.png")) == [
        "run_x_conditional_acceptance.png", "run_x_tau.png"]
    assert written["meta"]["reused"] == {"dspark": str(earlier), "eagle3": str(earlier)}
    assert written["contenders"]["eagle3"]["report"]["domains"]["1.0"]["macro"] == 1.6
    assert written["meta"]["settings"] == eval_settings(cfg)


def test_results_from_refuses_a_run_with_other_settings(tmp_path, monkeypatch, capsys):
    """Taus of another eval size or training budget do not pair: refused before any work, with
    the differing field named."""
    from pathlib import Path

    from benchmarks.drafter_quality import eval_settings
    from pipeline.config import load_config

    config = Path(__file__).resolve().parents[2] / "infra" / "configs" / "drafter_quality.yaml"
    run_dir = tmp_path / "dq"
    settings = eval_settings(load_config(str(config), [f"run_dir={run_dir}"]))
    earlier = earlier_results(tmp_path, {**settings, "max_new_tokens": 7})
    assert run_main(monkeypatch, "--contenders", "dspark,eagle3", "--set", f"run_dir={run_dir}",
                    "--results-from", str(earlier), "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "max_new_tokens: 7 there" in err
    assert not run_dir.exists() and not (tmp_path / "out").exists()
    (tmp_path / "old.json").write_text('{"meta": {}, "table": {}}')  # before reports were kept
    assert run_main(monkeypatch, "--contenders", "dspark", "--set", f"run_dir={run_dir}",
                    "--results-from", str(tmp_path / "old.json")) == 2
    assert "run them again" in capsys.readouterr().err
