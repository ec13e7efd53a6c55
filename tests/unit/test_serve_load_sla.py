"""The throughput-at-SLA reading of ``benchmarks/serve_load.py`` (issue 24): measured points that
hold the SLA, straight-line interpolation to where the slowest request crosses it, nothing
claimed where no point held it."""

from __future__ import annotations

import pytest

from benchmarks.serve_load import default_slas, render_sla_md, sla_rows, throughput_at_sla


def _points(policy, pairs):
    return [{"policy": policy, "concurrency": c, "throughput_tok_s": t, "per_user_tok_s_min": u}
            for c, (t, u) in zip((1, 2, 4, 8), pairs)]


POINTS = (_points("none", [(10, 10.0), (18, 9.0), (30, 7.5), (40, 5.0)])
          + _points("dspark", [(14, 14.0), (25, 12.5), (38, 9.5), (44, 5.5)]))


def test_measured_and_interpolated_throughput_at_an_sla():
    got = throughput_at_sla(POINTS, "none", 8.0)
    assert got["measured"] == 18 and got["concurrency"] == 2
    # between C=2 (9.0 tok/s, 18) and C=4 (7.5, 30): 8.0 lies 2/3 of the way -> 18 + 12 * 2/3
    assert got["interpolated"] == pytest.approx(26.0)
    d = throughput_at_sla(POINTS, "dspark", 8.0)
    assert d["measured"] == 38 and d["interpolated"] == pytest.approx(38 + 6 * 1.5 / 4)
    assert throughput_at_sla(POINTS, "none", 11.0) == {"measured": None, "concurrency": None,
                                                       "interpolated": None}
    # every point holds a low SLA: the best measured point, no crossing to interpolate
    assert throughput_at_sla(POINTS, "none", 1.0) == {"measured": 40, "concurrency": 8,
                                                      "interpolated": None}


def test_default_slas_and_table():
    slas = default_slas(POINTS)
    assert slas == [7.2, 9.5, 11.8]
    rows = sla_rows(POINTS, slas)
    assert [(r["sla_tok_s"], r["policy"]) for r in rows][:2] == [(7.2, "none"), (7.2, "dspark")]
    md = "\n".join(render_sla_md(rows))
    assert "| 11.8 | none | - | - |" in md and "| 11.8 | dspark | 25.0 (2) |" in md


def test_the_benchmark_prompts_load_from_the_shipped_sets():
    """``load_prompts`` (lost once in a patch, which broke serve_load, engine_step_profile and
    http_tax at their first line of work): first user turns of each prompt set, shuffled."""
    from pathlib import Path

    from benchmarks.serve_load import PROMPT_SETS, load_prompts

    root = Path(__file__).resolve().parents[2]
    got = load_prompts(root / "infra" / "datasets" / "eval", 2, 0)
    assert len(got) == 2 * len(PROMPT_SETS) and all(isinstance(p, str) and p for p in got)
    assert got == load_prompts(root / "infra" / "datasets" / "eval", 2, 0)


def test_the_floor_check_reads_each_floor_variants_slowest_request():
    from benchmarks.serve_load import floor_of, render_floor_md

    assert floor_of("dspark-min_tokens_per_s=12") == 12.0
    assert floor_of("dspark-min_tokens_per_s=1e-1") == 0.1
    assert floor_of("dspark-probe_budget=0.01") is None and floor_of("none") is None
    points = POINTS + _points("dspark-min_tokens_per_s=9", [(14, 14.0), (25, 12.5), (38, 9.5),
                                                             (44, 8.9)])
    points[-1]["engine_tok_s_min"] = 9.7  # the engine held what the client did not read
    md = "\n".join(render_floor_md(points))
    assert "| dspark-min_tokens_per_s=9 | 4 | 9 | 9.50 | n/a | yes |" in md
    assert "| dspark-min_tokens_per_s=9 | 8 | 9 | 8.90 | 9.70 | no |" in md
    assert "| none |" not in md and render_floor_md(POINTS) == []
