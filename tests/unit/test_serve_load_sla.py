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


def _runs(policy, repeat, pairs):
    return [dict(p, repeat=repeat) for p in _points(policy, pairs)]


def test_the_frontier_reads_each_floor_variant_at_its_own_floor_per_repeat():
    """Issue 43: the SLA-aware row at SLA S is the ``dspark-min_tokens_per_s=S`` deployment (not
    a variant set for another floor); each repeat is read alone beside the means; the ratio is
    over the best of none and fixed."""
    from benchmarks.serve_load import (SLA_AWARE, frontier_ratio, frontier_rows,
                                       render_frontier_md)

    floor8 = "dspark-min_tokens_per_s=8"
    floor12 = "dspark-min_tokens_per_s=12"
    runs = (_runs("none", 0, [(10, 10.0), (18, 9.0), (30, 7.5), (40, 5.0)])
            + _runs("none", 1, [(10, 10.0), (16, 8.5), (28, 7.0), (38, 4.0)])
            + _runs("fixed", 0, [(12, 13.0), (20, 10.0), (26, 6.0), (30, 3.0)])
            + _runs("fixed", 1, [(12, 13.0), (22, 10.5), (26, 6.0), (30, 3.0)])
            + _runs(floor8, 0, [(14, 14.0), (25, 12.0), (36, 8.5), (44, 6.0)])
            + _runs(floor8, 1, [(14, 14.0), (25, 12.0), (34, 8.1), (44, 6.0)])
            + _runs(floor12, 0, [(14, 14.0), (25, 12.5), (30, 12.1), (31, 12.0)])
            + _runs(floor12, 1, [(14, 14.0), (24, 12.2), (29, 12.0), (30, 11.0)]))
    # the means' points: mean throughput, slowest request over the repeats
    points = []
    for name in ("none", "fixed", floor8, floor12):
        for c in (1, 2, 4, 8):
            rs = [r for r in runs if r["policy"] == name and r["concurrency"] == c]
            points.append({"policy": name, "concurrency": c,
                           "throughput_tok_s": sum(r["throughput_tok_s"] for r in rs) / 2,
                           "per_user_tok_s_min": min(r["per_user_tok_s_min"] for r in rs)})
    rows = frontier_rows(points, runs, [8.0, 12.0])
    got = {(r["sla_tok_s"], r["policy"]): r for r in rows}
    assert set(got) == {(8.0, "none"), (8.0, "fixed"), (8.0, SLA_AWARE),
                        (12.0, "none"), (12.0, "fixed"), (12.0, SLA_AWARE)}
    assert got[(8.0, SLA_AWARE)]["variant"] == floor8  # not floor12, which also holds 8 tok/s
    assert got[(8.0, SLA_AWARE)]["measured"] == 35.0 and got[(8.0, SLA_AWARE)]["each"] == [36, 34]
    assert got[(12.0, SLA_AWARE)]["variant"] == floor12
    assert got[(12.0, SLA_AWARE)]["each"] == [31, 29]  # repeat 1 misses at C=8 (11.0)
    assert got[(8.0, "none")]["measured"] == 17.0 and got[(8.0, "none")]["each"] == [18, 16]
    assert got[(12.0, "none")]["measured"] is None and got[(12.0, "fixed")]["measured"] == 12.0
    ratio = frontier_ratio(rows, 8.0)
    assert ratio["means"] == pytest.approx(35.0 / 21.0)  # fixed: mean of 20 and 22 at C=2
    assert ratio["each"] == [pytest.approx(36 / 20), pytest.approx(34 / 22)]
    assert frontier_ratio(rows, 12.0)["means"] == pytest.approx(29.5 / 12.0)  # C=4 holds
    md = "\n".join(render_frontier_md(rows))
    assert f"| 8 | 17.0 (2) [18.0, 16.0] | 21.0 (2) [20.0, 22.0] | 35.0 (4) [36.0, 34.0] |" in md
    assert frontier_ratio(frontier_rows(points, runs, [9.0]), 9.0) is None  # no floor-9 deployment
    assert render_frontier_md(frontier_rows(points, runs, [9.0])) == []


def test_request_floor_variants_name_their_deployment_and_floor():
    """``dspark+min_tokens_per_s=12``: the ``dspark`` deployment, each request carrying a floor
    of 12 tokens/s; a malformed one is refused before anything starts."""
    from benchmarks.serve_load import (SLA_AWARE, SLA_AWARE_REQUEST, floor_of, policy_engine,
                                       request_floor_of, sla_aware_label)

    assert request_floor_of("dspark+min_tokens_per_s=12") == ("dspark", 12.0)
    assert request_floor_of("dspark-min_tokens_per_s=12") == ("dspark-min_tokens_per_s=12", None)
    assert floor_of("dspark+min_tokens_per_s=7.5") == 7.5
    assert sla_aware_label("dspark+min_tokens_per_s=7.5") == SLA_AWARE_REQUEST
    assert sla_aware_label("dspark-min_tokens_per_s=7.5") == SLA_AWARE
    assert sla_aware_label("dspark") is None
    assert policy_engine("dspark+min_tokens_per_s=12") == policy_engine("dspark")
    for bad in ("dspark+min_tokens_per_s=0", "dspark+threshold=0.5", "dspark+min_tokens_per_s=x"):
        with pytest.raises(SystemExit, match="request floor"):
            request_floor_of(bad)


def test_a_request_floor_variant_sends_its_floor_with_every_request():
    import asyncio
    import json

    import httpx

    from benchmarks.serve_load import run_point

    bodies = []

    def answer(request):
        bodies.append(json.loads(request.content))
        chunks = [{"choices": [{"delta": {"content": "hi"}}]},
                  {"choices": [], "usage": {"completion_tokens": 3}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    real = httpx.AsyncClient
    httpx.AsyncClient = lambda **kw: real(transport=httpx.MockTransport(answer), **kw)
    try:
        point = asyncio.run(run_point("http://bench/v1/chat/completions", "bench", ["a", "b"], 2,
                                      8, 60, 4, 1.0, 9.5))
        asyncio.run(run_point("http://bench/v1/chat/completions", "bench", ["a"], 1, 8, 60, 1))
    finally:
        httpx.AsyncClient = real
    assert point["requests"] == 4 and point["completion_tokens"] == 12
    assert [b.get("min_tokens_per_s") for b in bodies] == [9.5] * 4 + [None]


def test_the_frontier_puts_request_floor_variants_in_their_own_row():
    from benchmarks.serve_load import (SLA_AWARE_REQUEST, frontier_ratio, frontier_rows,
                                       render_frontier_md)

    name = "dspark+min_tokens_per_s=8"
    runs = (_runs("none", 0, [(10, 10.0), (18, 9.0), (30, 7.5), (40, 5.0)])
            + _runs("fixed", 0, [(12, 13.0), (20, 10.0), (26, 6.0), (30, 3.0)])
            + _runs(name, 0, [(14, 14.0), (25, 12.0), (36, 8.5), (44, 6.0)]))
    points = [dict(r) for r in runs]
    rows = frontier_rows(points, runs, [8.0])
    got = {r["policy"]: r for r in rows}
    assert got[SLA_AWARE_REQUEST]["variant"] == name and got[SLA_AWARE_REQUEST]["measured"] == 36
    assert frontier_ratio(rows, 8.0, SLA_AWARE_REQUEST)["means"] == pytest.approx(36 / 20)
    assert frontier_ratio(rows, 8.0) is None  # no deployment-floor row
    md = "\n".join(render_frontier_md(rows))
    assert f"| {SLA_AWARE_REQUEST} / best of none, fixed |" in md
    assert "| 8 | 18.0 (2) [18.0] | 20.0 (2) [20.0] | 36.0 (4) [36.0] | 1.80 [1.80] |" in md


def test_the_sla_test_can_be_a_quantile_of_the_requests_pooled_over_the_repeats():
    """``--sla-quantile 0.05``: a point holds the SLA when its 5th-percentile request does (one
    straggler no longer decides); 0 keeps the slowest request; the repeats' requests pool."""
    from benchmarks.serve_load import sla_speed, sla_test_text, summarize

    speeds = [float(v) for v in range(1, 22)]  # 1 .. 21 tok/s
    assert sla_speed(speeds) == 1.0 and sla_speed(speeds, 0.05) == pytest.approx(2.0)
    assert sla_speed([7.0, 3.0], 0.25) == pytest.approx(4.0) and sla_speed([], 0.05) == 0.0
    with pytest.raises(ValueError, match="quantile"):
        sla_speed(speeds, 0.5)
    base = {"policy": "dspark", "concurrency": 4, "requests": 2, "throughput_tok_s": 40.0,
            "per_user_tok_s": 10.0, "ttft_s_mean": 0.5, "mean_verification_budget": 1.0,
            "tau": 1.5, "engine_tok_s_min": None}
    runs = [dict(base, repeat=0, per_user_tok_s_min=2.0, per_user_speeds=[2.0] + [10.0] * 20),
            dict(base, repeat=1, per_user_tok_s_min=9.0, per_user_speeds=[9.0] * 21)]
    point = summarize(runs, ["dspark"], [4], 0.05)[0]
    assert point["per_user_tok_s_min"] == 2.0
    assert point["sla_speed_tok_s"] == pytest.approx(9.0)  # 42 requests: p5 between ranks 3 and 4
    assert throughput_at_sla([point], "dspark", 8.0)["measured"] == 40.0
    assert throughput_at_sla([dict(point, sla_speed_tok_s=2.0)], "dspark", 8.0)["measured"] is None
    assert "slowest request" in sla_test_text(0.0) and "the p5 (the 5 % quantile)" in sla_test_text(0.05)
