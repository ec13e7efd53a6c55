"""benchmarks/data_scaling.py's guards: the 'all' point may be the base run's own train stage
only as its config defines it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_points_and_the_all_point_guards():
    from benchmarks.data_scaling import all_point_note, check_base_run, parse_points

    assert parse_points("240, 960,all") == [240, 960, None]
    with pytest.raises(ValueError, match="--points"):
        parse_points("0")
    base = load_config(str(ROOT / "infra" / "configs" / "smollm2_reference.yaml"))
    check_base_run(base, ["cache.num_threads=1"])  # data-side overrides are the caller's business
    with pytest.raises(ValueError, match="--no-all-from-run"):
        check_base_run(base, ["train.lr=1e-4"])
    quiet = load_config(str(ROOT / "infra" / "configs" / "smollm2_reference.yaml"),
                        ["train.eval_every=null", "train.plateau_patience=null"])
    with pytest.raises(ValueError, match="eval_every"):
        check_base_run(quiet, [])
    note = all_point_note({"all_from_run": True, "base_train": base.train.model_dump()})
    assert f"every {base.train.eval_every} steps" in note
    assert f"at most {base.train.max_steps} steps" in note
    assert all_point_note({"all_from_run": False}) == ""


def test_results_keep_their_readings_when_a_point_is_added(tmp_path):
    """The md is rewritten after every point; a reading added below the table must survive."""
    from benchmarks.data_scaling import write_results

    def point(label, tokens, tau):
        return {"label": label, "rows": 10, "supervised_tokens": tokens, "steps": 100,
                "plateau": True, "best_step": 50, "heldout_accept_rate@1": 0.3,
                "heldout_tau": tau, "by_domain": {"chat": {"tau": tau - 0.1}}}

    meta = {"date": "d", "command": "c", "min_delta": 0.01, "patience": 4, "eval_every": 50,
            "max_steps": 4000, "block_size": 7}
    write_results([point("240", 1000, 1.5)], meta, tmp_path / "run")
    md = tmp_path / "run.md"
    md.write_text(md.read_text() + "\n## Reading (today)\n\nThe curve rises.\n")
    write_results([point("240", 1000, 1.5), point("960", 4000, 1.8)], meta, tmp_path / "run")
    text = md.read_text()
    assert "| 960 |" in text and text.count("## Reading (today)") == 1
    assert text.index("| 960 |") < text.index("## Reading (today)")
    assert text.rstrip().endswith("The curve rises.")


def test_an_added_run_must_hold_out_the_same_prompts(tmp_path):
    import json

    from benchmarks.data_scaling import all_point_note, check_same_heldout

    def run(name, ids):
        (tmp_path / name / "prompts").mkdir(parents=True)
        (tmp_path / name / "prompts" / "heldout.jsonl").write_text(
            "".join(json.dumps({"id": i, "messages": []}) + "\n" for i in ids))
        return tmp_path / name

    base, same, other = run("base", ["a", "b"]), run("same", ["b", "a"]), run("other", ["a", "c"])
    check_same_heldout(base, same)
    with pytest.raises(ValueError, match=r"other prompts .*\(1 not in the base run's, 1 missing\)"):
        check_same_heldout(base, other)
    with pytest.raises(FileNotFoundError, match="no prompts stage there yet"):
        check_same_heldout(base, tmp_path / "absent")
    for name, answer in (("base", "one"), ("same", "one")):
        (tmp_path / name / "generate").mkdir()
        (tmp_path / name / "generate" / "heldout.jsonl").write_text(json.dumps(
            {"id": "a", "messages": [{"role": "assistant", "content": answer}]}) + "\n")
    check_same_heldout(base, same)
    (same / "generate" / "heldout.jsonl").write_text(json.dumps(
        {"id": "a", "messages": [{"role": "assistant", "content": "two"}]}) + "\n")
    with pytest.raises(ValueError, match=r"answers 1 held-out prompt\(s\) differently"):
        check_same_heldout(base, same)
    note = all_point_note({"all_from_run": False, "also_runs": ["smollm2_reference_xl"]})
    assert "(smollm2_reference_xl) are that config's own run" in note
