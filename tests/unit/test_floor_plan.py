"""The drafting for per-user speed floors (serve/engine/floor_plan.py, issue 43.1), on hand-made
profiles: a 10 ms target pass at any B up to 32 tokens, a 6 ms drafter call whatever its size,
10 ms of the rest of a step. Four requests whose drafter accepts 30 % per token: the goodput plan
drafts for nobody (4 tokens in 10 ms = 400 tokens/s against 4 x 1.425 in 16 ms = 356), and each
request runs at 1 / 20 ms = 50 tokens/s counting the rest of the step."""

from __future__ import annotations

import pytest

from serve.engine.draft_planner import DraftCostTable, RequestOptions, plan_drafts
from serve.engine.floor_plan import FloorRow, StepRest, apply_floors, plan_for_floors, score_plan
from serve.engine.sps import SPSTable

SPS = SPSTable((100.0,) * 32)
COST = DraftCostTable((1,), ((0.006, 0.006),), ((0.006, 0.006),), 4)
REST = 0.01
E4 = 1 + 0.3 + 0.09 + 0.027 + 0.0081  # expected committed tokens verifying 4 drafts at alpha 0.3


def _rows(floors, alpha=0.3):
    return [FloorRow(f, alpha, 4, 0) for f in floors]


def test_score_plan_counts_the_pass_the_drafter_call_and_the_rest():
    none = score_plan(_rows([60.0] * 4), [0] * 4, SPS, COST, False, REST)
    assert none.speeds == pytest.approx((50.0,) * 4) and none.goodput == pytest.approx(200.0)
    assert none.worst == pytest.approx(50 / 60)
    drafted = score_plan(_rows([60.0] * 4), [4] * 4, SPS, COST, False, REST)
    assert drafted.speeds == pytest.approx((E4 / 0.026,) * 4)  # 54.8 tokens/s
    assert score_plan(_rows([None] * 4), [0] * 4, SPS, COST, False, REST).worst == 1.0
    # a pass beyond the profile's largest B grows in proportion: 4 + 4 x 9 = 40 tokens, 40/32 x
    wide = [FloorRow(None, 0.3, 9, 0) for _ in range(4)]
    assert score_plan(wide, [9] * 4, SPS, None, False).speeds == pytest.approx(
        (80.0 * (1 + sum(0.3 ** j for j in range(1, 10))),) * 4)


def test_floors_the_goodput_plan_keeps_change_nothing():
    assert plan_for_floors(_rows([40.0] * 4), SPS, COST, False, 32, REST) is None
    assert plan_for_floors(_rows([None] * 4), SPS, COST, False, 32, REST) is None


def test_requests_below_their_floor_are_drafted_for_where_it_raises_them():
    # all four below 60: drafting 4 for each raises them to 54.8 (the most any common length
    # reaches: the worst request's speed decides before throughput)
    assert plan_for_floors(_rows([60.0] * 4), SPS, COST, False, 32, REST) == [4] * 4
    # one request at risk, the others without floors: only it is drafted for (54.8 against 50;
    # the others fall to 38.5, which no floor forbids)
    assert plan_for_floors(_rows([60.0, None, None, None]), SPS, COST, False, 32,
                           REST) == [4, 0, 0, 0]
    # a drafter that accepts nothing cannot lift anyone: the goodput plan stays
    assert plan_for_floors(_rows([60.0] * 4, alpha=0.01), SPS, COST, False, 32, REST) is None
    # the token limit bounds the common length: 4 + 4 l <= 12 -> l = 2
    assert plan_for_floors(_rows([60.0] * 4), SPS, COST, False, 12, REST) == [2] * 4


def test_a_request_holding_its_floor_is_drafted_for_when_a_lift_would_take_it_below():
    # request 1 holds 45 at 50 tokens/s; drafting for request 0 alone makes every step 26 ms and
    # request 1 1 / 26 ms = 38.5 < 45; drafting for both keeps request 1 at 54.8
    rows = _rows([60.0, 45.0, None, None])
    assert plan_for_floors(rows, SPS, COST, False, 32, REST) == [4, 4, 0, 0]
    lifted = score_plan(rows, [4, 4, 0, 0], SPS, COST, False, REST)
    assert lifted.speeds[1] >= 45.0 and lifted.worst == pytest.approx(E4 / 0.026 / 60)


def test_apply_floors_rewrites_a_goodput_plan_and_leaves_lookup_rows_alone():
    options = [RequestOptions(4, 0.3) for _ in range(3)] + [
        RequestOptions(4, 0.3, lookup_len=3, lookup_alpha=0.8)]
    plan = plan_drafts(options, SPS, COST, False)
    assert plan.sources == [None, None, None, "lookup"]
    assert plan.predicted_lengths[3] == 3
    assert not apply_floors(plan, options, [None] * 4, SPS, COST, False, 32, REST)
    assert apply_floors(plan, options, [60.0] * 4, SPS, COST, False, 32, REST)
    assert plan.sources == ["model", "model", "model", "lookup"]
    assert plan.num_draft_tokens == [4, 4, 4, 3] and plan.probed == [False] * 4
    assert plan.predicted_lengths == [4, 4, 4, 3]
    with pytest.raises(ValueError, match="floors"):
        apply_floors(plan, options, [60.0], SPS, COST, False, 32, REST)


def test_apply_floors_keeps_the_rows_it_does_not_lengthen_as_they_were():
    """A kept row's drafts (fill drafts included) and a due probe stay as the goodput plan made
    them when the floor plan does not lengthen them; a lengthened row is no probe any more."""
    from serve.engine.draft_planner import DraftPlan

    options = [RequestOptions(4, 0.3), RequestOptions(4, 0.3), RequestOptions(4, 0.3)]
    plan = DraftPlan(["model", "model", None], [4, 1, 0], [[], [], []], [False, True, False],
                     predicted_lengths=[2, 0, 0], probe_cost_s=0.004)
    # only request 2 has a floor: lengthening it alone lifts it
    assert apply_floors(plan, options, [None, None, 60.0], SPS, COST, False, 32, REST)
    assert plan.sources == ["model", "model", "model"]
    assert plan.num_draft_tokens[:2] == [4, 1] and plan.probed[:2] == [False, True]
    assert plan.num_draft_tokens[2] == 4 and not plan.probed[2]
    assert plan.predicted_lengths == [2, 0, 4]
    assert plan.predicted_tps == pytest.approx(
        score_plan([FloorRow(None, 0.3, 4, 2), FloorRow(None, 0.3, 4, 0),
                    FloorRow(60.0, 0.3, 4, 0)], [2, 0, 4], SPS, COST, False, REST).goodput)


def test_floor_plans_stay_within_the_caps_and_the_token_limit():
    import random

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 6)
        rows = [FloorRow(rng.choice([None, rng.uniform(5, 120)]),
                         rng.choice([None, rng.uniform(0, 1)]), rng.randint(0, 7), 0,
                         1 + rng.randint(0, 2), 1.0 + rng.random()) for _ in range(n)]
        rows = [r if r.alpha is not None or r.cap == 0 else FloorRow(r.floor, None, 0, 0,
                                                                      r.fixed_tokens, r.fixed_gain)
                for r in rows]
        limit = rng.randint(n * 3, 40)
        got = plan_for_floors(rows, SPS, COST, rng.random() < 0.5, limit, rng.uniform(0, 0.05))
        if got is None:
            continue
        assert all(0 <= l <= r.cap and (r.alpha is not None or l == 0) for l, r in zip(got, rows))
        assert sum(r.fixed_tokens for r in rows) + sum(got) <= limit


def test_the_rest_of_a_step_is_a_line_in_the_tokens_verified():
    """StepRest: steps verifying 4 tokens took 20 ms beyond the pass and the drafter, steps
    verifying 12 took 36 ms: 12 ms + 2 ms per token; the first samples weigh equally; a slope
    below 0 (noise) reads as 0; with one B so far, the mean."""
    rest = StepRest()
    assert rest.seconds(10) == 0.0
    rest.observe(4, 0.020)
    assert rest.per_token_s == 0.0 and rest.seconds(12) == pytest.approx(0.020)
    for _ in range(5):
        rest.observe(12, 0.036)
        rest.observe(4, 0.020)
    assert rest.per_token_s == pytest.approx(0.002) and rest.fixed_s == pytest.approx(0.012)
    assert rest.seconds(8) == pytest.approx(0.028)
    falling = StepRest()
    falling.observe(4, 0.03)
    falling.observe(12, 0.01)
    assert falling.per_token_s == 0.0 and falling.fixed_s == pytest.approx(0.02)
    many = StepRest(window=4)
    for _ in range(40):
        many.observe(4, 0.01)
    many.observe(4, 0.09)  # after the window, a sample weighs 1/4
    assert many.seconds(4) == pytest.approx(0.03)


def test_a_rest_that_grows_with_the_tokens_verified_keeps_a_lift_from_paying():
    """With 10 ms of the rest fixed, drafting 4 for each of the four requests lifts them (see
    above); if the same rest also grows by 2 ms per verified token, a plan verifying 20 tokens
    costs 40 ms more and no lift raises anyone: the goodput plan stays."""
    assert plan_for_floors(_rows([60.0] * 4), SPS, COST, False, 32, REST) == [4] * 4
    assert plan_for_floors(_rows([60.0] * 4), SPS, COST, False, 32, REST - 0.008,
                           per_token_s=0.002) is None


def test_a_lengthened_row_keeps_the_drafts_a_fill_gave_it():
    from serve.engine.draft_planner import DraftPlan

    options = [RequestOptions(7, 0.3)]
    plan = DraftPlan(["model"], [6], [[]], [False], predicted_lengths=[1])  # a fill: 6 drafts
    assert apply_floors(plan, options, [60.0], SPS, COST, False, 32, REST)
    assert plan.predicted_lengths[0] > 1 and plan.num_draft_tokens[0] >= 6


def test_drafting_for_nobody_when_the_goodput_plans_drafts_slow_a_floored_request():
    """Request 0 (no floor) is drafted for by the goodput plan: every step takes 26 ms and
    request 1, which the drafter cannot draft for, runs at 38.5 tokens/s, under its 45. Drafting
    for nobody brings the step back to 20 ms (50 tokens/s): the floor plan drops the draft."""
    rows = [FloorRow(None, 0.9, 4, 4), FloorRow(45.0, None, 0, 0)]
    assert score_plan(rows, [4, 0], SPS, COST, False, REST).speeds[1] == pytest.approx(1 / 0.026)
    assert plan_for_floors(rows, SPS, COST, False, 32, REST) == [0, 0]
    options = [RequestOptions(4, 0.9), RequestOptions(0, None)]
    from serve.engine.draft_planner import DraftPlan

    plan = DraftPlan(["model", None], [5, 0], [[], []], [False, False], predicted_lengths=[4, 0])
    assert apply_floors(plan, options, [None, 45.0], SPS, COST, False, 32, REST)
    assert plan.sources == [None, None] and plan.num_draft_tokens == [0, 0]
    assert plan.predicted_lengths == [0, 0]


def test_a_lift_drops_the_other_drafts_when_they_keep_the_lifted_request_below_its_floor():
    """A pass of B tokens takes 8 + B ms. Request 1 (floor 70, acceptance 0.6) lifted to 4
    drafts beside request 0's four: B = 10, 18 + 6 + 10 = 34 ms, 2.31 / 34 ms = 67.8 < 70.
    Lifted alone: B = 6, 30 ms, 76.9 tokens/s; drafting for nobody: 50. So request 0's drafts
    go and request 1 drafts 4 (l = 4 beats 3 by throughput once both keep the floor)."""
    sps = SPSTable(tuple(1.0 / (0.008 + 0.001 * b) for b in range(1, 33)))
    rows = [FloorRow(None, 0.9, 4, 4), FloorRow(70.0, 0.6, 4, 0)]
    e4 = 1 + 0.6 + 0.36 + 0.216 + 0.1296
    assert score_plan(rows, [4, 4], sps, COST, False, REST).speeds[1] == pytest.approx(e4 / 0.034)
    assert plan_for_floors(rows, sps, COST, False, 32, REST) == [0, 4]
    assert score_plan(rows, [0, 4], sps, COST, False, REST).speeds[1] == pytest.approx(e4 / 0.030)


def test_drafting_for_nobody_lets_a_due_probe_wait():
    """When the floor plan drafts for nobody, a due probe would still call the drafter, a cost
    the plan was scored without: the probe waits (stays due) and the step calls no drafter."""
    from serve.engine.draft_planner import DraftPlan

    options = [RequestOptions(4, 0.9), RequestOptions(0, None), RequestOptions(4, 0.3)]
    plan = DraftPlan(["model", None, "model"], [5, 0, 1], [[], [], []], [False, False, True],
                     predicted_lengths=[4, 0, 0], probe_cost_s=0.001)
    assert apply_floors(plan, options, [None, 45.0, None], SPS, COST, False, 32, REST)
    assert plan.sources == [None, None, None] and plan.num_draft_tokens == [0, 0, 0]
    assert plan.probed == [False] * 3 and plan.probe_cost_s == 0.0
