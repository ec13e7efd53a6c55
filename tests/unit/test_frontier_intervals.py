"""Bootstrap intervals of serve_load's frontier ratios (issue 43): the repeats are drawn paired
across policies, a ratio whose interval lies above 1 reads "above", one that holds 1 a tie, no
interval is claimed from too few repeats, and a finished run's files are rewritten from its JSON
with its readings kept."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.frontier_intervals import bootstrap_intervals, resample_runs, verdict


def run(policy, concurrency, repeat, throughput, speeds):
    return {"policy": policy, "concurrency": concurrency, "repeat": repeat,
            "requests": len(speeds), "throughput_tok_s": throughput, "per_user_tok_s":
            sum(speeds) / len(speeds), "ttft_s_mean": 0.5, "mean_verification_budget": 0.0,
            "tau": 1.0, "per_user_tok_s_min": min(speeds), "per_user_speeds": speeds}


def test_a_draw_takes_whole_repeats_for_every_policy_and_resamples_their_requests():
    runs = [run(p, 4, k, 10.0 * (k + 1), [float(k + 1)] * 5 + [100.0])
            for k in range(4) for p in ("none", "dspark")]
    rng = random.Random(3)
    for _ in range(20):
        drawn = resample_runs(runs, rng)
        assert sorted({r["repeat"] for r in drawn}) == [0, 1, 2, 3]
        for slot in range(4):
            pair = [r for r in drawn if r["repeat"] == slot]
            # both policies of a slot come from the same measured repeat (paired)
            assert len(pair) == 2 and pair[0]["throughput_tok_s"] == pair[1]["throughput_tok_s"]
            k = pair[0]["throughput_tok_s"] / 10.0 - 1
            for r in pair:
                assert set(r["per_user_speeds"]) <= {k + 1, 100.0}
                assert r["per_user_tok_s_min"] == min(r["per_user_speeds"])
    assert runs[0]["per_user_speeds"] == [1.0] * 5 + [100.0]  # the measured runs untouched


def test_intervals_read_above_below_and_tie():
    runs = [run("x", 1, k, 1.0, [1.0, 2.0, 3.0]) for k in range(3)]
    got = bootstrap_intervals(runs, lambda rs: {"const": 2.0, "none": None,
                                                "mean": sum(r["per_user_tok_s_min"]
                                                            for r in rs) / len(rs)}, draws=200)
    assert got["const"] == (2.0, 2.0) and got["none"] is None
    lo, hi = got["mean"]
    assert 1.0 <= lo < hi <= 3.0
    # the ends are the 2.5th and 97.5th percentiles of the draws: with 40 draws whose values
    # are 0..39, one draw left out on each side
    counter = iter(range(10_000))
    ends = bootstrap_intervals(runs, lambda rs: {"k": float(next(counter) % 41)}, draws=40)
    assert ends["k"] == (2.0, 39.0)  # the measured runs' call took 0; the draws are 1..40
    counter = iter(range(10_000))
    few = bootstrap_intervals(runs, lambda rs: {"k": float(next(counter))}, draws=10)
    assert few["k"] == (1.0, 10.0)  # 10 draws: none left out on either side, symmetric
    assert verdict((1.02, 1.3)) == "above" and verdict((0.7, 0.99)) == "below"
    assert verdict((0.9, 1.1)) == "tie" and verdict(None) == "n/a"
    assert bootstrap_intervals(runs, lambda rs: {"m": len(rs)}, draws=50) == \
        bootstrap_intervals(runs, lambda rs: {"m": len(rs)}, draws=50)  # seeded
    with pytest.raises(ValueError):
        bootstrap_intervals(runs, lambda rs: {}, draws=0)


def frontier_runs(aware_speeds):
    """none holds 8 tok/s at 2 streams (20 tok/s) in every repeat; the request-floor-8 variant
    holds it at 4 streams (36 tok/s) with p5 speeds ``aware_speeds``."""
    runs = []
    for k in range(5):
        runs += [run("none", 2, k, 20.0 + k, [9.0] * 20), run("none", 4, k, 30.0, [6.0] * 20),
                 run("dspark+min_tokens_per_s=8", 2, k, 22.0, [10.0] * 20),
                 run("dspark+min_tokens_per_s=8", 4, k, 36.0 + k, aware_speeds)]
    return runs


def test_the_frontier_ratio_separates_only_when_its_interval_excludes_1():
    from benchmarks.serve_load import (SLA_AWARE_REQUEST, frontier_intervals, frontier_ratios,
                                       render_frontier_md, frontier_rows, summarize)

    runs = frontier_runs([9.0] * 20)
    assert frontier_ratios(runs, [8.0], 0.05)[(SLA_AWARE_REQUEST, 8.0)] == pytest.approx(
        38.0 / 22.0)
    band = frontier_intervals(runs, [8.0], 0.05, draws=200)[(SLA_AWARE_REQUEST, 8.0)]
    # paired draws: a draw's mean repeat index m moves both sides, (36 + m) / (20 + m) >= 40 / 24
    assert verdict(band) == "above" and band[0] >= 40.0 / 24.0 - 1e-9
    points = summarize(runs, ["none", "dspark+min_tokens_per_s=8"], [2, 4], 0.05)
    md = "\n".join(render_frontier_md(frontier_rows(points, runs, [8.0]), 0.05,
                                      {(SLA_AWARE_REQUEST, 8.0): band}))
    assert f"; 95 %: {band[0]:.2f}-{band[1]:.2f}, above |" in md
    # the variant's 4-stream p5 straddles the SLA: some draws hold it there, some fall back to
    # 2 streams (22 against none's 20-23): a tie
    straddling = frontier_runs([7.0] * 2 + [8.5] * 18)
    band = frontier_intervals(straddling, [8.0], 0.05, draws=300)[(SLA_AWARE_REQUEST, 8.0)]
    assert verdict(band) == "tie"
    # fewer than 5 repeats, runs without their requests' speeds, or the slowest request as the
    # SLA test (a resampled minimum never falls below the measured one): no interval claimed
    assert frontier_intervals([r for r in runs if r["repeat"] < 4], [8.0], 0.05) == {}
    assert frontier_intervals([dict(r, per_user_speeds=[]) for r in runs], [8.0], 0.05) == {}
    assert frontier_intervals(runs, [8.0], 0.0) == {}
    # where none and fixed hold the SLA nowhere and the SLA-aware row does: unbounded, above
    slow_none = [dict(r, per_user_speeds=[6.0] * 20, per_user_tok_s_min=6.0)
                 if r["policy"] == "none" else r for r in runs]
    assert frontier_ratios(slow_none, [8.0], 0.05)[(SLA_AWARE_REQUEST, 8.0)] == float("inf")
    assert frontier_intervals(slow_none, [8.0], 0.05, draws=50)[(SLA_AWARE_REQUEST, 8.0)] == (
        float("inf"), float("inf"))


def test_a_finished_run_is_rendered_again_from_its_json_with_its_readings(tmp_path, monkeypatch):
    from benchmarks import serve_load

    monkeypatch.setattr(serve_load, "plots", lambda *a, **k: None)  # matplotlib files aside
    runs = frontier_runs([9.0] * 20)
    meta = {"target": "t", "drafter": "d", "dtype": "float32", "max_tokens": 48,
            "temperature": 1.0, "duration_s": 15, "min_requests": 1000, "concurrency": [2, 4],
            "repeats": 4, "sla_quantile": 0.05, "machine": "m", "wall_minutes": 1.0,
            "command": "c", "slas": [8.0]}
    stem = "2026-12-07_avx512-bf16_x"  # dots and dashes in the stem
    serve_load.write_results(tmp_path / stem, meta, runs)
    md_path = tmp_path / f"{stem}.md"
    md_path.write_text(md_path.read_text().replace("95 %:", "OLD:")
                       + "\n## Reading (today)\n\nA tie.\n")
    for _ in range(2):  # twice: the readings are kept once, not appended again
        serve_load.rerender(tmp_path / f"{stem}.json")
    text = md_path.read_text()
    assert "OLD:" not in text and "95 %:" in text and text.endswith("## Reading (today)\n\nA tie.\n")
    assert text.count("## Reading") == 1
    saved = json.loads((tmp_path / f"{stem}.json").read_text())
    assert saved["frontier_intervals"][0]["verdict"] == "above" and saved["runs"] == runs
    assert saved["frontier_intervals"][0]["repeats"] == 5
    (tmp_path / "bad.json").write_text('{"points": []}')
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "old.json").write_text(json.dumps({"meta": {"slas": [8.0]}, "runs": runs}))
    for name, says in (("bad.json", "not a serve_load result"), ("text.json", "not a serve_load"),
                       ("missing.json", "not a serve_load"), ("old.json", "'concurrency'")):
        with pytest.raises(SystemExit, match=says):
            serve_load.rerender(tmp_path / name)
    assert not (tmp_path / "old.md").exists()  # nothing written for a file it refused
