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
