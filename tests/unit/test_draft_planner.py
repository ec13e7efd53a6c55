"""The goodput planner (serve/engine/draft_planner.py) and prompt-lookup candidates
(serve/engine/lookup.py): cost-table lookups, acceptance estimates, which requests are drafted for
and from which source."""

from __future__ import annotations

import pytest

from serve.engine.draft_planner import (AcceptanceEstimate, DraftCostTable, RequestOptions,
                                 expected_accepted, plan_drafts)
from serve.engine.lookup import NgramIndex
from serve.engine.scheduler import SPSTable

FLAT = SPSTable.from_measurements({1: 100.0, 16: 96.0})  # a CPU-like flat curve: 10 ms a step


def _cost(seconds_at_1: float, seconds_at_block: float, block_size: int = 4) -> DraftCostTable:
    pair = (seconds_at_1, seconds_at_block)
    return DraftCostTable((1, 4), (pair, (2 * pair[0], 2 * pair[1])),
                          ((pair[0] * 1.5, pair[1] * 1.5), (3 * pair[0], 3 * pair[1])), block_size)


def test_cost_table_interpolates_rows_and_draft_tokens_and_validates():
    t = _cost(0.002, 0.008)
    assert t.seconds(1, 1, False) == pytest.approx(0.002)
    assert t.seconds(1, 4, False) == pytest.approx(0.008)
    assert t.seconds(1, 2, False) == pytest.approx(0.004)  # affine in num_draft_tokens
    assert t.seconds(4, 4, False) == pytest.approx(0.016)
    assert t.seconds(2, 1, False) == pytest.approx(0.002 + (0.004 - 0.002) / 3)
    assert t.seconds(9, 9, True) == pytest.approx(0.024)  # clamped beyond the grid
    assert t.seconds(0, 3, True) == 0.0 and t.seconds(3, 0, True) == 0.0
    assert DraftCostTable.from_dict(t.to_dict()) == t
    # tables stored before block_size was named so (key max_depth) still load
    old = {k: v for k, v in t.to_dict().items() if k != "block_size"}
    assert DraftCostTable.from_dict({**old, "max_depth": 4}) == t
    with pytest.raises(ValueError, match="start at 1"):
        DraftCostTable((2,), ((0.1, 0.1),), ((0.1, 0.1),), 4)
    with pytest.raises(ValueError, match="finite"):
        DraftCostTable((1,), ((float("nan"), 0.1),), ((0.1, 0.1),), 4)


def test_acceptance_estimate_starts_at_the_prior_and_follows_recent_rounds():
    est = AcceptanceEstimate()
    assert est.alpha == 0.5
    for _ in range(20):
        est.update(0.0, 1.0)
    assert est.alpha < 0.2
    for _ in range(20):
        est.update(3.0, 3.0)
    assert est.alpha > 0.9
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)


def test_plan_drafts_a_confident_request_and_skips_one_whose_drafts_cost_more_than_they_bring():
    cost = _cost(0.004, 0.006)  # 40-60 % of a 10 ms verification
    plan = plan_drafts([RequestOptions(4, 0.9), RequestOptions(4, 0.05)], FLAT, cost, False)
    assert plan.sources == ["model", None] and plan.num_draft_tokens[0] >= 2 and plan.num_draft_tokens[1] == 0
    # alone, the weak request is not drafted for at all: the step is a target-only step
    alone = plan_drafts([RequestOptions(4, 0.05)], FLAT, cost, False)
    assert alone.sources == [None] and alone.num_draft_tokens == [0]
    assert alone.predicted_tps == pytest.approx(100.0)
    # free drafting: Algorithm 1's prediction alone decides, so even alpha 0.05 is worth a token
    free = plan_drafts([RequestOptions(4, 0.05)], FLAT, None, False)
    assert free.sources == ["model"] and free.num_draft_tokens == [2]  # predicted l = 1, plus one


def test_plan_probes_a_skipped_request_and_marks_it():
    cost = _cost(0.004, 0.006)
    plan = plan_drafts([RequestOptions(4, 0.05, probe_due=True)], FLAT, cost, True)
    assert plan.sources == ["model"] and plan.num_draft_tokens[0] >= 1 and plan.probed == [True]
    kept = plan_drafts([RequestOptions(4, 0.9, probe_due=True)], FLAT, cost, True)
    assert kept.probed == [False]


def test_plan_prefers_a_lookup_draft_that_is_at_least_as_good_and_gives_its_confidences():
    cost = _cost(0.001, 0.002)  # cheap: a step of three requests gains from drafting one
    plan = plan_drafts([RequestOptions(4, 0.4, lookup_len=3, lookup_alpha=0.8),
                        RequestOptions(4, 0.8, lookup_len=2, lookup_alpha=0.3),
                        RequestOptions(0, None, lookup_len=0)], FLAT, cost, False)
    assert plan.sources == ["lookup", "model", None]
    assert plan.num_draft_tokens[0] == 3 and plan.lookup_confidences[0] == [0.8] * 3
    assert plan.lookup_confidences[1] == [] and plan.num_draft_tokens[2] == 0


def test_ngram_index_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    idx = NgramIndex([1, 2, 3, 9, 1, 2, 4, 7, 1, 2], max_n=3, min_n=1)
    # suffix (1, 2) last occurred before at index 4 -> followed by 4, 7, 1, 2
    assert idx.propose(3) == [4, 7, 1]
    idx.extend([3])  # suffix (1, 2, 3) occurred at the start -> 9, 1, 2 ...
    assert idx.propose(2) == [9, 1]
    assert NgramIndex([5, 6, 7], max_n=2, min_n=2).propose(4) == []  # no repeat, no draft
    short = NgramIndex([5, 6, 5], max_n=2, min_n=1)
    assert short.propose(4) == [6, 5]  # the continuation may run into the suffix itself
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex([1], max_n=1, min_n=2)


def test_plan_drops_every_hopeless_row_when_the_drafter_call_has_a_fixed_cost():
    """Four weak rows and a drafter call whose cost does not depend on the rows: dropping one row
    saves nothing, dropping all four saves the call; the plan must find the latter (a greedy
    one-row-at-a-time descent stops at the first step)."""
    fixed = DraftCostTable((1,), ((0.005, 0.005),), ((0.005, 0.005),), 4)
    plan = plan_drafts([RequestOptions(4, 0.16) for _ in range(4)], FLAT, fixed, False)
    assert plan.sources == [None] * 4
    assert plan.predicted_tps == pytest.approx(plan.predicted_tps_without_drafter)
    strong = plan_drafts([RequestOptions(4, 0.95) for _ in range(4)], FLAT, fixed, False)
    assert strong.sources == ["model"] * 4


def test_probes_wait_for_the_budget_and_then_go_together():
    """Due probes whose extra drafter cost exceeds the allowance are not drafted (and stay due);
    with enough allowance they are all drafted in one call and the plan says what they cost.
    Next to a kept row a probe costs only what it adds to that call."""
    cost = _cost(0.004, 0.006)
    due = [RequestOptions(4, 0.05, probe_due=True) for _ in range(3)]
    poor = plan_drafts(due, FLAT, cost, False, probe_allowance_s=0.001)
    assert poor.sources == [None] * 3 and poor.probed == [False] * 3 and poor.probe_cost_s == 0
    rich = plan_drafts(due, FLAT, cost, False, probe_allowance_s=1.0)
    assert rich.sources == ["model"] * 3 and rich.probed == [True] * 3
    assert rich.probe_cost_s == pytest.approx(cost.seconds(3, max(rich.num_draft_tokens), False))
    mixed = plan_drafts([RequestOptions(4, 0.95), RequestOptions(4, 0.05, probe_due=True)], FLAT,
                        cost, False, probe_allowance_s=1.0)
    num_draft_tokens = max(mixed.num_draft_tokens)
    assert mixed.probed == [False, True]
    assert mixed.probe_cost_s == pytest.approx(cost.seconds(2, num_draft_tokens, False)
                                               - cost.seconds(1, num_draft_tokens, False))


def test_a_plan_that_drafts_must_promise_the_minimum_gain():
    """One request whose predicted gain from drafting is a few per cent: drafted for when any gain
    counts, not under a 10 % margin; a strong request clears the margin."""
    cost = _cost(0.002, 0.003)
    marginal = [RequestOptions(4, 0.3)]
    free_for_all = plan_drafts(marginal, FLAT, cost, False, min_gain=0.0)
    gain = free_for_all.predicted_tps / free_for_all.predicted_tps_without_drafter - 1
    assert free_for_all.sources == ["model"] and 0 < gain < 0.1
    assert plan_drafts(marginal, FLAT, cost, False, min_gain=0.1).sources == [None]
    assert plan_drafts([RequestOptions(4, 0.9)], FLAT, cost, False, min_gain=0.1).sources == ["model"]


def test_a_context_backlog_is_priced_into_drafting_and_probes():
    """A request whose drafter context lags 200 positions (its prompt, say) pays for extending
    them: a probe the allowance covers without the backlog waits with it, and a row that would
    pay with a current context is not drafted while the backlog makes the call too dear."""
    base = _cost(0.002, 0.003)
    cost = DraftCostTable(base.rows, base.greedy_s, base.sampled_s, base.block_size,
                          extend_s_per_position=0.0001)
    assert cost.backlog_seconds(2) == 0.0 and cost.backlog_seconds(202) == pytest.approx(0.02)
    assert DraftCostTable.from_dict(cost.to_dict()) == cost
    assert DraftCostTable.from_dict({**base.to_dict(), "extend_s_per_position": 0.0}) == base
    due = [RequestOptions(4, 0.05, probe_due=True, pending=202)]
    assert plan_drafts(due, FLAT, cost, False, probe_allowance_s=0.01).probed == [False]
    rich = plan_drafts(due, FLAT, cost, False, probe_allowance_s=1.0)
    assert rich.probed == [True] and rich.probe_cost_s == pytest.approx(
        cost.seconds(1, max(rich.num_draft_tokens), False) + 0.02)
    assert plan_drafts([RequestOptions(4, 0.6)], FLAT, cost, False).sources == ["model"]
    assert plan_drafts([RequestOptions(4, 0.6, pending=202)], FLAT, cost, False).sources == [None]
    with pytest.raises(ValueError, match="extend_s_per_position"):
        DraftCostTable((1,), ((0.1, 0.1),), ((0.1, 0.1),), 4, extend_s_per_position=-1.0)


def test_probes_wait_while_even_a_good_draft_would_not_pay_at_this_load():
    """A CPU-like linear SPS curve: every verified token costs what a decoded one does, so at
    a batch of 16 a request accepting 80 % of its drafts would not pay for its drafter call and
    the extra verification; no probe result could change the plan, so the due probes wait (and
    stay due). At a batch of 2 the same probes go ahead."""
    linear = SPSTable.from_measurements({b: 100.0 / b for b in (1, 2, 4, 8, 16, 32, 64, 128)})
    cost = _cost(0.004, 0.006)
    busy = [RequestOptions(4, 0.05, probe_due=True) for _ in range(16)]
    held = plan_drafts(busy, linear, cost, True, probe_allowance_s=1.0, probe_alpha=0.8)
    assert held.sources == [None] * 16 and held.probe_cost_s == 0
    # a perfect draft (alpha 1) pays even here: with probe_alpha 1.0 the probes go ahead
    eager = plan_drafts(busy, linear, cost, True, probe_allowance_s=1.0, probe_alpha=1.0)
    assert eager.probed == [True] * 16
    quiet = [RequestOptions(4, 0.05, probe_due=True) for _ in range(2)]
    flat = plan_drafts(quiet, FLAT, cost, True, probe_allowance_s=1.0, probe_alpha=0.8)
    assert flat.probed == [True, True] and flat.probe_cost_s > 0


# fp32 on AVX2 (measured shape): a pass of 2 to 4 tokens is slower than one of 5 to 8
JAGGED = SPSTable((100.0, 40.0, 40.0, 40.0, 90.0, 88.0, 86.0, 84.0, 60.0, 50.0))


def test_with_filled_passes_the_planner_drafts_enough_to_fill_the_pass():
    """On the measured jagged curve a request accepting 60 % is never worth drafting for (one
    draft token costs SPS 100 -> 40); with filled passes it is, and the drafter drafts the
    tokens that reach the faster pass. A request whose cap leaves the pass short of the fast
    length is planned on the slow speed it would get (the envelope's promise needs drafts)."""
    cost = DraftCostTable((1,), ((0.001, 0.002),), ((0.001, 0.002),), 7)
    one = [RequestOptions(cap=7, model_alpha=0.6)]
    assert plan_drafts(one, JAGGED, cost, False).sources == [None]
    plan = plan_drafts(one, JAGGED, cost, False, fills=True)
    assert plan.sources == ["model"] and 5 <= 1 + plan.num_draft_tokens[0] <= 8
    # Algorithm 1 on predicted confidences of 0.3: the envelope is flat from 2 to 5 tokens, so it
    # verifies every predicted token there; the fill-to length is then reached by drafting more
    low = plan_drafts([RequestOptions(cap=7, model_alpha=0.3)], JAGGED, cost, False, fills=True)
    assert low.sources == ["model"] and 1 + low.num_draft_tokens[0] >= 5
    # a cap of 3 drafts reaches a pass of 4 tokens at most: all in the dip, nothing pays
    short = plan_drafts([RequestOptions(cap=3, model_alpha=0.6)], JAGGED, cost, False, fills=True)
    assert short.sources == [None] and short.predicted_tps_without_drafter == 100.0


def test_filled_plan_drafts_the_fill_for_the_rows_it_keeps():
    """Two requests; A's context is 8 positions behind (its extension costs 8 ms), so the plan
    keeps B alone. B's predicted 4 tokens put the pass at 6, in the dip (SPS 50 from 2 to 7
    tokens, 95 at 8): B must draft 2 more than l + 1 for the pass to be filled to 8, and the plan
    is valued (and chosen) only because it does. Drafting for nobody is valued at the measured
    SPS(2) = 50 (no drafts, no fill), not the envelope's 95."""
    table = SPSTable((100.0,) + (50.0,) * 6 + (95.0, 60.0))
    cost = DraftCostTable((1,), ((0.001, 0.002),), ((0.001, 0.002),), 7,
                          extend_s_per_position=0.001)
    options = [RequestOptions(cap=7, model_alpha=0.6, pending=10),
               RequestOptions(cap=7, model_alpha=0.8)]
    plan = plan_drafts(options, table, cost, False, fills=True)
    assert plan.sources == [None, "model"] and plan.num_draft_tokens == [0, 7]
    assert plan.predicted_tps_without_drafter == 2 * 50.0


def test_with_filled_passes_a_probe_is_weighed_at_the_speed_its_pass_can_reach():
    """A keeps a 2-token draft (1 predicted verified), B's probe is due. A probe at 1 token puts
    the pass at 4 tokens, measured 20 steps/s; but A's spare draft and the probe's own second
    token let the pass be filled to 6 tokens (50 steps/s, Algorithm 1 on the envelope), the speed
    the plan's cuts are valued at too. At that speed a perfect probe would pay, so B is probed;
    weighed at the measured 20, it would not be."""
    table = SPSTable((95.0, 95.0, 100.0, 20.0, 50.0, 10.0, 50.0))
    cost = DraftCostTable((1,), ((0.001, 0.002),), ((0.001, 0.002),), 7)
    options = [RequestOptions(cap=2, model_alpha=0.95),
               RequestOptions(cap=3, model_alpha=0.5, probe_due=True)]
    plan = plan_drafts(options, table, cost, False, fills=True)
    assert plan.sources == ["model", "model"] and plan.num_draft_tokens == [2, 1]
    assert plan.probed == [False, True]
    unfilled = plan_drafts(options, table, cost, False, fills=False)
    assert unfilled.probed == [False, False]  # the measured curve: no probe could pay here
