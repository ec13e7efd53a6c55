"""Verification-length schedulers (SPEC 6; DSpark Algorithm 1, section 5.2, Appendix A).

Hand-computed Algorithm 1 tables, the SPS table, the baselines, the registry, an admissibility
property ("verify x_{r,k}" never depends on confidences computed from x_{r,k}), and exact
losslessness checks: the output distribution is computed by enumerating every draft sample, the
real scheduler's decision for it, and the rejection-sampling accept / resample probabilities, in
exact rational arithmetic.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest
import torch

from serve.engine.scheduler import (
    ScheduleResult,
    SPSTable,
    async_schedule,
    dspark_schedule,
    fixed_schedule,
    full_search_capacity,
    no_speculation_schedule,
    prefix_survival,
    static_threshold_schedule,
)
from serve.engine.plan_extensions import fill_pass, hold_speed_floors
from serve.engine.scheduler_registry import SCHEDULER_NAMES, make_scheduler

# ---- SPSTable -----------------------------------------------------------------------------------

JAGGED = SPSTable((17.0, 9.0, 8.0, 9.8, 10.9, 9.9, 7.6, 11.3, 11.0, 10.7))  # fp32 on AVX2, measured


def test_padded_table_is_the_upper_envelope_with_its_fill_lengths():
    padded = JAGGED.padded()
    assert padded.sps_by_batch == (17.0, 11.3, 11.3, 11.3, 11.3, 11.3, 11.3, 11.3, 11.0, 10.7)
    assert [padded.fill_target(b) for b in range(1, 11)] == [1, 8, 8, 8, 8, 8, 8, 8, 9, 10]
    assert all(a >= b for a, b in zip(padded.sps_by_batch, padded.sps_by_batch[1:]))
    # a cap on the pass (the engine's token budget) bounds both
    capped = JAGGED.padded(6)
    assert capped.max_tokens == 6 and capped.sps_by_batch[1:] == (10.9,) * 4 + (9.9,)
    assert [capped.fill_target(b) for b in range(1, 7)] == [1, 5, 5, 5, 5, 6]
    # ties go to the shorter pass; a non-increasing table keeps its values and lengths
    assert SPSTable((5.0, 4.0, 4.0)).padded().fill_to == (1, 2, 3)
    # a measured table fills nothing; scaling keeps the fill lengths
    assert JAGGED.fill_target(3) == 3 and padded.scaled(2.0).fill_to == padded.fill_to
    with pytest.raises(ValueError, match="max_tokens"):
        JAGGED.padded(11)
    with pytest.raises(ValueError, match="fill_to"):
        SPSTable((2.0, 1.0), (2, 1))


def test_fill_pass_hand_cases():
    # one request, Algorithm 1 on the padded table verifies 1 of 6 drafts (B = 2); filling to
    # the fastest reachable pass, B* = 5 (SPS 10.9 beats 9.0, 8.0, 9.8), verifies 4
    conf = [[0.9, 0.1, 0.5, 0.5, 0.5, 0.5]]
    assert fill_pass(conf, [1], JAGGED) == [4]
    # only 2 spare drafts: B* in [2, 4] is 4 (9.8 > 9.0 > 8.0)
    assert fill_pass([[0.9, 0.1, 0.5]], [1], JAGGED) == [3]
    # two requests, B = 3, 4 spare drafts: B* in [3, 7] is 5 (10.9); the 2 tokens go to the
    # next candidates in Algorithm 1's order, a = 0.72 (request 0) before a = 0.5 (request 1)
    two = [[0.9, 0.8, 0.0], [0.5, 0.5]]
    assert fill_pass(two, [1, 0], JAGGED) == [2, 1]
    # a candidate with a = 0 still fills (verifying it is lossless, only unlikely to pay)
    assert fill_pass([[0.9, 0.0, 0.0, 0.0]], [1], JAGGED) == [4]
    # capped at 3 tokens: B = 2 stays, SPS(2) = 9.0 beats SPS(3) = 8.0
    assert fill_pass(two, [0, 0], JAGGED, max_batch_tokens=3) == [0, 0]
    # nothing to fill: no spare draft, a pass at the fastest length, or a plan beyond the cap
    assert fill_pass([[0.9]], [1], JAGGED) == [1]
    assert fill_pass([[0.9] * 8], [7], JAGGED) == [7]
    assert fill_pass([[0.9] * 3] * 4, [3] * 4, JAGGED, max_batch_tokens=10) == [3] * 4
    with pytest.raises(ValueError, match="lengths"):
        fill_pass([[0.9]], [2], JAGGED)


def test_sps_table_lookup_and_range():
    t = SPSTable((10, 9.5, 9.0))
    assert t.max_tokens == 3
    assert t.sps(1) == 10.0 and t.sps(3) == 9.0
    assert t.sps(np.int64(2)) == 9.5
    assert all(isinstance(v, float) for v in t.sps_by_batch)
    for b in (0, 4, -1):
        with pytest.raises(ValueError, match=rf"b={b}.*\[1, 3\]"):
            t.sps(b)


@pytest.mark.parametrize("values", [(), (1.0, 0.0), (1.0, -2.0), (math.nan,), (1.0, math.inf)])
def test_sps_table_rejects_bad_values(values):
    with pytest.raises(ValueError):
        SPSTable(values)


def test_sps_table_is_frozen():
    t = SPSTable((1.0,))
    with pytest.raises(AttributeError):
        t.sps_by_batch = (2.0,)


def test_sps_table_from_measurements_interpolates():
    t = SPSTable.from_measurements({8: 3.0, 1: 10.0, 4: 7.0})
    # 1 -> 4: 10, 9, 8, 7 (slope -1); 4 -> 8: 7, 6, 5, 4, 3 (slope -1)
    assert t.sps_by_batch == (10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0)
    assert SPSTable.from_measurements({1: 10.0, 3: 9.0}).sps_by_batch == (10.0, 9.5, 9.0)
    assert SPSTable.from_measurements({1: 10.0, 4: 7.0}, max_tokens=2).sps_by_batch == (10.0, 9.0)
    assert SPSTable.from_measurements({1: 5.0}).sps_by_batch == (5.0,)


def test_sps_table_from_measurements_rejects_extrapolation_and_bad_input():
    with pytest.raises(ValueError, match="largest measured size 4"):
        SPSTable.from_measurements({1: 10.0, 4: 7.0}, max_tokens=5)
    with pytest.raises(ValueError, match="B=1"):
        SPSTable.from_measurements({2: 10.0, 4: 7.0})
    with pytest.raises(ValueError):
        SPSTable.from_measurements({})
    with pytest.raises(ValueError):
        SPSTable.from_measurements({0: 1.0, 2: 1.0})
    with pytest.raises(ValueError, match="SPS"):
        SPSTable.from_measurements({1: 10.0, 4: -1.0})


def test_sps_table_json_round_trip():
    t = SPSTable.from_measurements({1: 10.0, 3: 9.1, 7: 2.3})
    back = SPSTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    # a padded table keeps its fill lengths (its speeds hold only for filled passes)
    padded = JAGGED.padded()
    back = SPSTable.from_dict(json.loads(json.dumps(padded.to_dict())))
    assert back == padded and back.fill_target(2) == 8
    assert "fill_to" not in t.to_dict()
    with pytest.raises(ValueError, match="sps"):
        SPSTable.from_dict({"values": [1.0]})
    with pytest.raises(ValueError, match="unit"):
        SPSTable.from_dict({"unit": "ms", "sps": [1.0]})


# ---- prefix survival ----------------------------------------------------------------------------


def test_prefix_survival():
    a = prefix_survival([[0.5, 0.5, 1.0], [], [1.0, 0.0, 0.7]])
    assert a == [[0.5, 0.25, 0.25], [], [1.0, 0.0, 0.0]]
    assert prefix_survival(torch.tensor([[0.5, 0.5]])) == [[0.5, 0.25]]
    assert prefix_survival(np.array([[0.5, 0.5]])) == [[0.5, 0.25]]
    for bad in ([[1.5]], [[-0.1]], [[math.nan]]):
        with pytest.raises(ValueError, match="request 0 at draft position 1"):
            prefix_survival(bad)
    with pytest.raises(ValueError, match="R rows"):
        prefix_survival([0.5, 0.5])   # a flat list, not rows


# ---- Algorithm 1 hand tables --------------------------------------------------------------------

# B:          1     2     3    4    5    6    7    8
SPS_SMOOTH = SPSTable((10.0, 10.0, 9.5, 9.0, 8.0, 7.0, 6.0, 5.0))


def test_dspark_two_requests_hand_table():
    # a: r0 = (0.9, 0.72, 0.36); r1 = (0.6, 0.3, 0.3)
    # order: (0,1) .9, (0,2) .72, (1,1) .6, (0,3) .36, (1,2) .3, (1,3) .3 (tie: smaller j first)
    # start B=2 tau=2    Theta = 2    * 10  = 20
    # (0,1) B=3 tau=2.9  Theta = 2.9  * 9.5 = 27.55  > 20     admit
    # (0,2) B=4 tau=3.62 Theta = 3.62 * 9   = 32.58  > 27.55  admit
    # (1,1) B=5 tau=4.22 Theta = 4.22 * 8   = 33.76  > 32.58  admit
    # (0,3) B=6 tau=4.58 Theta = 4.58 * 7   = 32.06 <= 33.76  stop
    conf = [[0.9, 0.8, 0.5], [0.6, 0.5, 1.0]]
    assert dspark_schedule(conf, SPS_SMOOTH) == [2, 1]
    res = dspark_schedule(conf, SPS_SMOOTH, return_result=True)
    assert isinstance(res, ScheduleResult)
    assert res.lengths == [2, 1] and res.batch_tokens == 5
    assert res.expected_tokens == pytest.approx(4.22)
    assert res.throughput_tps == pytest.approx(33.76)
    # the full search continues: (1,2) B=7 4.88*6 = 29.28, (1,3) B=8 5.18*5 = 25.9; best K = 5
    assert full_search_capacity(conf, SPS_SMOOTH) == 5
    # the same input as a tensor / array
    assert dspark_schedule(torch.tensor(conf), SPS_SMOOTH) == [2, 1]
    assert dspark_schedule(np.array(conf), SPS_SMOOTH) == [2, 1]


def test_dspark_three_requests_ties_zeros_and_empty_rows():
    sps = SPSTable((8.0, 8.0, 8.0, 8.0, 8.0, 7.5, 7.0, 4.0))
    # r0 a = (.5, .5, .5) (three-way tie), r1 has no drafts, r2 a = (1, 0, 0) (zero: never a
    # candidate). Order: (2,1) 1, (0,1) .5, (0,2) .5, (0,3) .5
    # start B=3 tau=3   Theta = 24
    # (2,1) B=4 tau=4   Theta = 4   * 8   = 32    admit
    # (0,1) B=5 tau=4.5 Theta = 4.5 * 8   = 36    admit
    # (0,2) B=6 tau=5   Theta = 5   * 7.5 = 37.5  admit
    # (0,3) B=7 tau=5.5 Theta = 5.5 * 7   = 38.5  admit; no candidates left
    conf = [[0.5, 1.0, 1.0], [], [1.0, 0.0, 1.0]]
    res = dspark_schedule(conf, sps, return_result=True)
    assert res.lengths == [3, 0, 1]
    assert (res.batch_tokens, res.expected_tokens, res.throughput_tps) == (7, 5.5, 38.5)
    # max_batch_tokens=6 stops before (0,3); a 5-entry table stops before (0,2)
    assert dspark_schedule(conf, sps, max_batch_tokens=6) == [2, 0, 1]
    assert dspark_schedule(conf, SPSTable(sps.sps_by_batch[:5])) == [1, 0, 1]


def test_dspark_edge_cases():
    assert dspark_schedule([], SPS_SMOOTH) == []
    assert dspark_schedule([], SPS_SMOOTH, return_result=True) == ScheduleResult.make_empty()
    assert dspark_schedule([[], []], SPS_SMOOTH) == [0, 0]
    assert dspark_schedule([[0.0, 1.0]], SPS_SMOOTH) == [0]
    # more requests than the table covers: target-only step, Theta unknown
    res = dspark_schedule([[1.0]] * 3, SPSTable((5.0, 5.0)), return_result=True)
    assert res.lengths == [0, 0, 0] and res.throughput_tps is None
    assert full_search_capacity([[1.0]] * 3, SPSTable((5.0, 5.0))) == 3
    # a Theta tie is not an improvement: Theta(B=1) = 1 * 1.0 = 1, Theta(B=2) = 2 * 0.5 = 1 -> stop
    # (and the full search keeps the smaller K on ties)
    assert dspark_schedule([[1.0]], SPSTable((1.0, 0.5))) == [0]
    assert full_search_capacity([[1.0]], SPSTable((1.0, 0.5))) == 1
    with pytest.raises(ValueError, match="max_batch_tokens"):
        dspark_schedule([[1.0]], SPS_SMOOTH, max_batch_tokens=0)
    with pytest.raises(ValueError, match="SPSTable"):
        dspark_schedule([[1.0]], [10.0, 10.0])


# Flat, then a sharp cliff at B = 5, recovering from B = 6 (a jagged kernel-tile profile).
# B:         1     2     3     4     5    6    7    8    9    10
SPS_CLIFF = SPSTable((10.0, 10.0, 10.0, 10.0, 4.0, 9.0, 9.0, 8.0, 7.0, 6.0))
# a: r0 = (1, .75, .75, .375); r1 = (.75, .75, .375, .1875) (all exact in binary)
# order: (0,1) 1, (1,1) .75, (0,2) .75, (1,2) .75, (0,3) .75, (1,3) .375, (0,4) .375, (1,4) .1875
CLIFF_CONF = [[1.0, 0.75, 1.0, 0.5], [0.75, 1.0, 0.5, 0.5]]


def test_cliff_early_stop_versus_full_search():
    # start B=2  tau=2      Theta = 20
    # (0,1) B=3  tau=3      Theta = 3      * 10 = 30      admit
    # (1,1) B=4  tau=3.75   Theta = 3.75   * 10 = 37.5    admit
    # (0,2) B=5  tau=4.5    Theta = 4.5    * 4  = 18      early stop (Algorithm 1 ends here)
    # the full search goes on:
    # (1,2) B=6  tau=5.25   Theta = 5.25   * 9  = 47.25
    # (0,3) B=7  tau=6      Theta = 6      * 9  = 54      <- best, K = 7
    # (1,3) B=8  tau=6.375  Theta = 6.375  * 8  = 51
    # (0,4) B=9  tau=6.75   Theta = 6.75   * 7  = 47.25
    # (1,4) B=10 tau=6.9375 Theta = 6.9375 * 6  = 41.625
    res = dspark_schedule(CLIFF_CONF, SPS_CLIFF, return_result=True)
    assert res.lengths == [1, 1] and res.batch_tokens == 4 and res.throughput_tps == 37.5
    assert full_search_capacity(CLIFF_CONF, SPS_CLIFF) == 7
    assert full_search_capacity(CLIFF_CONF, SPS_CLIFF, max_batch_tokens=6) == 6
    assert full_search_capacity(CLIFF_CONF, SPS_CLIFF, max_batch_tokens=5) == 4
    assert full_search_capacity(CLIFF_CONF, SPSTable(SPS_CLIFF.sps_by_batch[:8])) == 7


# current a: r0 = (.5, .25, .125, .0625); r1 = (1, 1, 1, 0)
# current order: (1,1) 1, (1,2) 1, (1,3) 1, (0,1) .5, (0,2) .25, (0,3) .125, (0,4) .0625
CURRENT_CONF = [[0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 0.0]]


def test_async_capacity_from_stale_admission_from_current():
    # K = 7 from the stale (cliff) confidences -> 7 - 2 = 5 draft tokens, taken top-5 from the
    # current order: (1,1), (1,2), (1,3), (0,1), (0,2)
    assert async_schedule(CURRENT_CONF, CLIFF_CONF, SPS_CLIFF) == [2, 3]
    # Algorithm 1 on the current confidences would stop at the cliff instead:
    # 20 -> (1,1) 3*10 = 30 -> (1,2) 4*10 = 40 -> (1,3) 5*4 = 20 stop
    assert dspark_schedule(CURRENT_CONF, SPS_CLIFF) == [0, 2]
    # capacity depends on the stale confidences only: stale with no candidates -> K = R
    assert async_schedule(CURRENT_CONF, [[0.0] * 4, [0.0] * 4], SPS_CLIFF) == [0, 0]
    # admission depends on the current order only, not on the current values
    reordered_same = [[0.4, 0.5, 0.5, 0.5], [0.9, 1.0, 1.0, 0.0]]
    assert async_schedule(reordered_same, CLIFF_CONF, SPS_CLIFF) == [2, 3]
    # a budget larger than the candidates admits them all, never a zero-survival token:
    # K = 7 but the current batch has only 3 candidates
    assert async_schedule([[1.0, 0.0], [1.0, 1.0]], CLIFF_CONF, SPS_CLIFF) == [1, 2]
    # warm-up (no stale confidences yet): Algorithm 1 on the current confidences
    assert async_schedule(CURRENT_CONF, None, SPS_CLIFF) == [0, 2]


def test_async_request_count_changes_and_limits():
    # stale: one request, a = (1, 1): 10 -> 2*10 = 20 -> 3*10 = 30, K = 3
    assert full_search_capacity([[1.0, 1.0]], SPS_CLIFF) == 3
    # two current requests: budget 3 - 2 = 1 draft token, the top current candidate (1,1)
    assert async_schedule(CURRENT_CONF, [[1.0, 1.0]], SPS_CLIFF) == [0, 1]
    # three current requests exceed K = 3... only anchors: budget 0
    assert async_schedule(CURRENT_CONF + [[1.0]], [[1.0, 1.0]], SPS_CLIFF) == [0, 0, 0]
    # max_batch_tokens caps K: K = 4 -> budget 2
    assert async_schedule(CURRENT_CONF, CLIFF_CONF, SPS_CLIFF, max_batch_tokens=4) == [0, 2]
    assert async_schedule([], CLIFF_CONF, SPS_CLIFF) == []


# ---- baselines ----------------------------------------------------------------------------------


def test_speed_floors_lift_the_slowest_request_first_and_keep_the_others():
    # Algorithm 1 verifies request 0's a_1 = 0.9 and a_2 = 0.45 (theta 24.65, then 25.125) and
    # stops before request 1's a_1 = 0.2 (3.55 * 7.0 = 24.85 < 25.125): B = 4, SPS 7.5
    sps = SPSTable((10.0, 9.5, 8.5, 7.5, 7.0, 6.5))
    conf = [[0.9, 0.5], [0.2, 0.9]]
    base = dspark_schedule(conf, sps)
    assert base == [2, 0]
    # request 1 runs at 1 * 7.5 < its floor 7.6: verifying its x_1 lifts it to 1.2 * 7.0 = 8.4,
    # and request 0 (2.35 * 7.0 = 16.45) keeps its floor of 12; then both hold theirs
    assert hold_speed_floors(conf, base, sps, [12.0, 7.6]) == [2, 1]
    # a floor request 0 would lose (2.35 * 7.0 = 16.45 < 17 <= 2.35 * 7.5): no extension
    assert hold_speed_floors(conf, base, sps, [17.0, 7.6]) == [2, 0]
    # no floors, or floors already held: the plan is unchanged (and not mutated)
    assert hold_speed_floors(conf, base, sps, [None, None]) == [2, 0] == base
    assert hold_speed_floors(conf, base, sps, [1.0, 1.0]) == [2, 0]
    # a request that cannot be lifted (no drafts, or a floor out of reach) does not keep the
    # others from being lifted
    assert hold_speed_floors([[0.9, 0.9], []], [0, 0], sps, [12.0, None]) == [1, 0]
    assert hold_speed_floors([[0.9, 0.9], []], [0, 0], sps, [12.0, 100.0]) == [1, 0]
    # verification that lowers the request's own speed is never added
    assert hold_speed_floors([[0.01]], [0], SPSTable((10.0, 5.0)), [20.0]) == [0]
    with pytest.raises(ValueError, match="floors"):
        hold_speed_floors(conf, base, sps, [1.0])


def test_speed_floors_count_the_step_beyond_the_pass():
    """A floor the pass alone would keep is missed once the rest of the step is counted: request
    0 verifying nothing runs at 1 x SPS(1) = 10 tokens/s by the pass alone, above its floor of
    9; with 20 ms of drafting and bookkeeping a step takes 0.12 s (8.3 tokens/s), and verifying
    x_1 (a = 0.9) makes it 1.9 / (1 / 9.5 + 0.02) = 15.2 tokens/s."""
    sps = SPSTable((10.0, 9.5, 8.5, 7.5, 7.0, 6.5))
    assert hold_speed_floors([[0.9, 0.9]], [0], sps, [9.0]) == [0]
    assert hold_speed_floors([[0.9, 0.9]], [0], sps, [9.0], fixed_s=0.02) == [1]
    # a floor of 16: x_2 (a = 0.81) too, 2.71 / (1 / 8.5 + 0.02) = 19.6
    assert hold_speed_floors([[0.9, 0.9]], [0], sps, [16.0], fixed_s=0.02) == [2]
    # a rest growing by 0.3 s per token of B (a slow step, to keep the numbers round): x_1
    # raises 1 / (0.1 + 0.02 + 0.3) = 2.38 tokens/s to 1.9 / (0.105 + 0.02 + 0.6) = 2.62; x_2
    # would lower it to 2.71 / (0.118 + 0.02 + 0.9) = 2.61, so it stays unverified
    assert hold_speed_floors([[0.9, 0.9]], [0], sps, [16.0], fixed_s=0.02,
                             per_token_s=0.3) == [1]


def test_static_threshold_hand_table():
    conf = [[0.9, 0.9, 0.9],   # a = .9, .81, .729 -> 3 at 0.5, 1 at 0.85
            [0.5, 1.0, 1.0],   # a = .5, .5, .5    -> 3 at 0.5 (>= keeps equality), 0 at 0.85
            [0.6, 0.5, 1.0],   # a = .6, .3, .3    -> 1 at 0.5
            [0.4, 1.0],        # a = .4, .4        -> 0
            []]
    assert static_threshold_schedule(conf, 0.5) == [3, 3, 1, 0, 0]
    assert static_threshold_schedule(conf, 0.85) == [1, 0, 0, 0, 0]
    assert static_threshold_schedule(conf, 0.0) == [3, 3, 3, 2, 0]
    assert static_threshold_schedule([[1.0, 0.0, 1.0]], 0.0) == [3]
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="threshold"):
            static_threshold_schedule(conf, bad)


def test_fixed_and_none():
    assert fixed_schedule(3, 2) == [2, 2, 2]
    assert fixed_schedule([3, 1, 0], 2) == [2, 1, 0]
    assert fixed_schedule(np.array([4, 1]), 3) == [3, 1]
    assert fixed_schedule([], 7) == [] and fixed_schedule(0, 7) == []
    assert fixed_schedule([5], 0) == [0]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        fixed_schedule(2, -1)
    with pytest.raises(ValueError):
        fixed_schedule([1, -1], 2)
    assert no_speculation_schedule(3) == [0, 0, 0]
    assert no_speculation_schedule(0) == []
    with pytest.raises(ValueError):
        no_speculation_schedule(-1)


# ---- registry -----------------------------------------------------------------------------------


def test_make_scheduler_uniform_signature():
    scheds = {
        "dspark": make_scheduler("dspark", sps=SPS_CLIFF),
        "async": make_scheduler("async", sps=SPS_CLIFF),
        "static_threshold": make_scheduler("static_threshold", threshold=0.5),
        "fixed": make_scheduler("fixed", num_speculative_tokens=2),
        "none": make_scheduler("none"),
    }
    assert tuple(scheds) == SCHEDULER_NAMES
    expected = {"dspark": [0, 2], "async": [2, 3], "static_threshold": [1, 3],
                "fixed": [2, 2], "none": [0, 0]}
    for name, sched in scheds.items():
        assert sched.name == name
        assert sched(CURRENT_CONF, CLIFF_CONF) == expected[name], name
    assert scheds["async"](CURRENT_CONF) == [0, 2]        # warm-up fallback
    assert scheds["fixed"]([[1.0], [], [1.0] * 4]) == [1, 0, 2]
    capped = make_scheduler("dspark", sps=SPS_CLIFF, max_batch_tokens=3)
    assert capped(CURRENT_CONF) == [0, 1]


def test_make_scheduler_errors():
    with pytest.raises(ValueError, match="dspark, async, static_threshold, fixed, none"):
        make_scheduler("greedy")
    with pytest.raises(ValueError, match="missing \\['sps'\\]"):
        make_scheduler("dspark")
    with pytest.raises(ValueError, match="unexpected \\['num_speculative_tokens'\\]"):
        make_scheduler("none", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="threshold"):
        make_scheduler("static_threshold", threshold=2.0)
    with pytest.raises(ValueError, match="SPSTable"):
        make_scheduler("async", sps={"sps": [1.0]})


# ---- admissibility property ---------------------------------------------------------------------

_CONF_VALUES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.9, 1.0)


def _conf_value(rng: random.Random, first: bool) -> float:
    """A confidence: exact ties, zeros and ones next to generic values; c_1 is mostly high, as
    real drafters' are, so that later positions reach the scheduler's margin."""
    if first:
        return rng.choice((0.75, 0.9, 1.0)) if rng.random() < 0.3 else rng.uniform(0.5, 1.0)
    return rng.choice(_CONF_VALUES) if rng.random() < 0.6 else rng.random()


def _random_conf(rng: random.Random, num_requests: int, gamma: int) -> list[list[float]]:
    """Rows of mixed lengths 0..gamma."""
    return [[_conf_value(rng, j == 0) for j in range(rng.randint(0, gamma))]
            for _ in range(num_requests)]


def _random_sps(rng: random.Random, max_tokens: int) -> SPSTable:
    """Flat (memory-bound) up to a knee, then falling as (knee / B)^p, with occasional sharp dips
    (jagged kernel-tile effects)."""
    knee, p = rng.randint(1, max_tokens), rng.uniform(0.3, 1.0)
    return SPSTable(tuple(10.0 * min(1.0, knee / b) ** p
                          * (rng.uniform(0.5, 0.9) if rng.random() < 0.15 else 1.0)
                          for b in range(1, max_tokens + 1)))


def _random_floors(rng: random.Random, num_requests: int) -> list[float | None]:
    return [None if rng.random() < 0.3 else rng.uniform(5.0, 40.0) for _ in range(num_requests)]


def _with_floors(base, sps: SPSTable, floors: list, max_batch_tokens=None, fixed_s=0.0,
                 per_token_s=0.0):
    """``base``'s plan extended by :func:`hold_speed_floors` (floors cycled over the requests)."""
    def sched(conf):
        rows = [list(r) for r in conf]
        own = [floors[r % len(floors)] for r in range(len(rows))]
        return hold_speed_floors(rows, base(rows), sps, own, max_batch_tokens, fixed_s,
                                 per_token_s)
    return sched


def _filled(base, sps: SPSTable, max_batch_tokens=None):
    """``base`` (built on ``sps.padded()``), its pass then filled on the measured ``sps``."""
    return lambda conf: fill_pass(conf, base(conf), sps, max_batch_tokens)


def _reach_filled(sps: SPSTable, floors: list | None = None):
    """The engine's filled plan: Algorithm 1 (with floors when given) on the envelope up to the
    pass the proposals allow, R + sum_r K_r tokens (fixed before drafting), then the fill."""
    def sched(conf):
        table = sps.padded(min(sps.max_tokens, len(conf) + sum(len(row) for row in conf)))
        base = make_scheduler("dspark", sps=table)
        if floors is not None:
            base = _with_floors(base, table, floors)
        return fill_pass(conf, base(conf), sps)
    return sched


def _lossless_schedulers(rng: random.Random, sps: SPSTable, gamma: int):
    stale = _random_conf(rng, rng.randint(1, 3), gamma)
    floors = _random_floors(rng, 3)
    padded = sps.padded()
    return {
        "dspark_reach_filled": _reach_filled(sps),
        "dspark_floors_reach_filled": _reach_filled(sps, floors),
        "dspark_jagged_reach_filled": _reach_filled(JAGGED),
        "dspark_filled": _filled(make_scheduler("dspark", sps=padded), sps),
        "async_filled": _filled(lambda c: async_schedule(c, stale, padded), sps),
        "dspark_floors_filled": _filled(_with_floors(make_scheduler("dspark", sps=padded), padded,
                                                     floors), sps),
        "dspark_capped_filled": _filled(make_scheduler("dspark", sps=sps.padded(
            min(sps.max_tokens, 4)), max_batch_tokens=4), sps, 4),
        # on the measured CPU profile the fill changes plans often (on the padded table it only
        # adds candidates with a = 0): lossless on top of any lossless plan
        "dspark_jagged_filled": _filled(make_scheduler("dspark", sps=JAGGED), JAGGED),
        "dspark_jagged_padded_filled": _filled(make_scheduler("dspark", sps=JAGGED.padded()),
                                               JAGGED),
        "dspark_floors": _with_floors(make_scheduler("dspark", sps=sps), sps, floors),
        # the step beyond the pass (drafter call, the measured rest)
        "dspark_floors_rest": _with_floors(make_scheduler("dspark", sps=sps), sps, floors,
                                           fixed_s=0.02, per_token_s=0.002),
        "async_floors": _with_floors(lambda c: async_schedule(c, stale, sps), sps, floors, 6),
        "static_floors": _with_floors(make_scheduler("static_threshold", threshold=0.7), sps,
                                      floors),
        "dspark": make_scheduler("dspark", sps=sps),
        "dspark_capped": make_scheduler("dspark", sps=sps, max_batch_tokens=rng.randint(1, 8)),
        "async": lambda c: async_schedule(c, stale, sps),
        "async_capped": lambda c: async_schedule(c, stale, sps, max_batch_tokens=5),
        "async_warmup": make_scheduler("async", sps=sps),
        "static_threshold": make_scheduler("static_threshold", threshold=rng.random()),
        "fixed": make_scheduler("fixed", num_speculative_tokens=rng.randint(0, gamma)),
        "none": make_scheduler("none"),
    }


def _own_future_violations(sched, conf: list[list[float]], rng: random.Random, tries: int = 3):
    """(r, k) where "l_r >= k" changed when c_{r,k+1..} (computed from x_{r,k}) were redrawn."""
    lengths = sched(conf)
    violations = []
    for r, row in enumerate(conf):
        for k in range(1, len(row) + 1):
            for _ in range(tries):
                changed = [list(x) for x in conf]
                changed[r][k:] = [_conf_value(rng, False) for _ in row[k:]]
                if (sched(changed)[r] >= k) != (lengths[r] >= k):
                    violations.append((r, k, changed))
    return violations


def _property_instance(seed: int):
    rng = random.Random(seed)
    num_requests, gamma = rng.randint(1, 5), rng.randint(1, 5)
    sps = _random_sps(rng, rng.randint(1, 20))
    return rng, sps, gamma, _random_conf(rng, num_requests, gamma)


@pytest.mark.parametrize("seed", range(40))
def test_verify_decision_never_reads_its_own_future(seed):
    """l_r >= k must not change when c_{r,k+1..} change; l_r in [0, gamma_r]; the plan fits the
    batch limit."""
    rng, sps, gamma, conf = _property_instance(seed)
    for name, sched in _lossless_schedulers(rng, sps, gamma).items():
        lengths = sched(conf)
        assert len(lengths) == len(conf)
        assert all(0 <= l_r <= len(row) for l_r, row in zip(lengths, conf)), name
        if name.startswith(("dspark", "async")) and any(lengths):
            table = JAGGED if "jagged" in name else sps
            assert len(conf) + sum(lengths) <= table.max_tokens, name
        if name == "dspark_capped_filled" and any(lengths):
            assert len(conf) + sum(lengths) <= 4, name
        assert not _own_future_violations(sched, conf, rng), name


def test_floor_extension_is_exercised_by_the_property_instances():
    """Coverage guard for the floors variants above: on these random instances the extension
    really changes Algorithm 1's plan often enough for the checks to mean something."""
    changed = 0
    for seed in range(200):
        rng, sps, _, conf = _property_instance(seed)
        base = dspark_schedule(conf, sps)
        changed += hold_speed_floors(conf, base, sps, _random_floors(rng, len(conf))) != base
    assert changed >= 10, changed


def test_fill_is_exercised_by_the_property_instances():
    """Coverage guard for the filled variants: on the measured jagged profile filling really
    changes Algorithm 1's plan often enough for the checks to mean something (both on these
    property instances and on the exact ones)."""
    changed = exact = 0
    for seed in range(200):
        _, _, _, conf = _property_instance(seed)
        base = dspark_schedule(conf, JAGGED)
        changed += fill_pass(conf, base, JAGGED) != base
    assert changed >= 10, changed
    for seed in range(NUM_RANDOM_INSTANCES):
        _, reqs, gamma, vocab, _, _ = _random_instance(seed)
        conf = [[req.conf[()]] + [0.5] * (gamma - 1) for req in reqs]
        base = dspark_schedule(conf, JAGGED)
        exact += fill_pass(conf, base, JAGGED) != base
    assert exact >= 3, exact


def _peeking_schedule(conf: list[list[float]]) -> list[int]:
    """A deliberately biased rule: verify x_1 (and x_2) only when c_2 (from x_1) is high."""
    return [0 if len(row) < 2 or row[1] < 0.5 else min(len(row), 2) for row in conf]


def test_own_future_property_has_teeth():
    """The property catches a rule that peeks at c_2, and the full search run on the current draft
    (the global search of Appendix A: redrawing c_2 after x_1 flips whether x_1 is verified)."""
    peeking = 0
    for seed in range(40):
        rng, _, _, conf = _property_instance(seed)
        peeking += bool(_own_future_violations(_peeking_schedule, conf, rng))
    assert peeking >= 10, peeking
    full_search_on_current = lambda c: async_schedule(c, c, SPS_APPENDIX)  # noqa: E731
    assert _own_future_violations(full_search_on_current, [[0.8, 0.9]], random.Random(0), tries=20)
    # control: with SPS(2) = 0.6 Algorithm 1 verifies x_1 whatever c_2 is
    assert not _own_future_violations(lambda c: dspark_schedule(c, SPS_APPENDIX_VERIFY),
                                      [[0.8, 0.9]], random.Random(0), tries=20)


# ---- exact losslessness by enumeration ----------------------------------------------------------


def _uniform(vocab: int) -> tuple[Fraction, ...]:
    return tuple(Fraction(1, vocab) for _ in range(vocab))


@dataclass
class _Request:
    """One request's exact model.

    p_t[prefix]: target next-token distribution after the output prefix (output tokens so far);
    p_d[prefix]: drafter distribution of draft slot k given draft tokens x_<k (len(prefix) = k-1);
    conf[prefix]: the confidence c_k the drafter reports for slot k given x_<k. Like the Markov
    confidence head, c_k is computed from x_{k-1}, so it carries information about x_{k-1}.
    """

    p_t: dict[tuple[int, ...], tuple[Fraction, ...]]
    p_d: dict[tuple[int, ...], tuple[Fraction, ...]]
    conf: dict[tuple[int, ...], float]


def _draft_samples(req: _Request, gamma: int, vocab: int):
    """Every draft block x_1..x_gamma with its probability under the drafter."""
    for seq in itertools.product(range(vocab), repeat=gamma):
        prob = Fraction(1)
        for k in range(gamma):
            prob *= req.p_d[seq[:k]][seq[k]]
        if prob:
            yield seq, prob


def _round_outputs(req: _Request, drafts: tuple[int, ...], l: int, m: int, vocab: int):
    """Distribution of the first m output tokens given the drafts and the verification length l.

    Standard speculative sampling (SPEC 5): for k = 1..l accept x_k with min(1, p_t/p_d); at the
    first rejection sample from norm(max(0, p_t - p_d)) and end the round; if all l pass, sample a
    bonus token from p_t. Tokens after the round come from later rounds, which are lossless by
    induction, so they are drawn from p_t.
    """
    out: dict[tuple[int, ...], Fraction] = defaultdict(Fraction)

    def walk(prefix: tuple[int, ...], prob: Fraction, in_round: bool) -> None:
        if not prob:
            return
        if len(prefix) == m:
            out[prefix] += prob
            return
        p_t = req.p_t[prefix]
        k = len(prefix) + 1                   # in the round, prefix == drafts[:k-1] (accepted)
        if in_round and k <= l:
            x, p_d = drafts[k - 1], req.p_d[drafts[:k - 1]]
            accept = min(Fraction(1), p_t[x] / p_d[x])
            walk(prefix + (x,), prob * accept, True)
            if accept < 1:
                residual = [max(Fraction(0), t - d) for t, d in zip(p_t, p_d)]
                total = sum(residual)
                for v in range(vocab):
                    walk(prefix + (v,), prob * (1 - accept) * residual[v] / total, False)
        else:                                 # bonus token, or a later (target) round
            for v in range(vocab):
                walk(prefix + (v,), prob * p_t[v], False)

    walk((), Fraction(1), True)
    return out


def _output_distribution(reqs: list[_Request], schedule, gamma: int, vocab: int, m: int):
    """Exact joint distribution of the first m output tokens of every request.

    For every combination of draft samples (one block per request) the real scheduler sees the
    confidences [c_1, c_2(x_1), ..., c_gamma(x_<gamma)] of every request and returns l; the output
    given (drafts, l) is then exact rejection sampling (:func:`_round_outputs`).
    """
    joint: dict[tuple, Fraction] = defaultdict(Fraction)
    samples = [list(_draft_samples(req, gamma, vocab)) for req in reqs]
    for combo in itertools.product(*samples):
        weight = math.prod((p for _, p in combo), start=Fraction(1))
        conf = [[req.conf[seq[:k]] for k in range(gamma)] for req, (seq, _) in zip(reqs, combo)]
        lengths = schedule(conf)
        per_request = [_round_outputs(req, seq, l_r, m, vocab).items()
                       for req, (seq, _), l_r in zip(reqs, combo, lengths)]
        for outs in itertools.product(*per_request):
            joint[tuple(o for o, _ in outs)] += weight * math.prod((p for _, p in outs),
                                                                   start=Fraction(1))
    return dict(joint)


def _target_distribution(reqs: list[_Request], vocab: int, m: int):
    """The target-only joint distribution: each request samples m tokens from p_t, independently."""
    per_request = []
    for req in reqs:
        dist = {}
        for seq in itertools.product(range(vocab), repeat=m):
            dist[seq] = math.prod((req.p_t[seq[:i]][seq[i]] for i in range(m)),
                                  start=Fraction(1))
        per_request.append(dist.items())
    return {tuple(o for o, _ in outs): math.prod((p for _, p in outs), start=Fraction(1))
            for outs in itertools.product(*per_request)}


def _nonzero(dist):
    return {k: v for k, v in dist.items() if v}


# Appendix A: one request, gamma = 2, vocabulary {A, B}.
A, B = 0, 1
APPENDIX_REQ = _Request(
    p_t={(): (Fraction(7, 10), Fraction(3, 10))},
    p_d={(): _uniform(2), (A,): _uniform(2), (B,): _uniform(2)},
    conf={(): 0.8, (A,): 0.9, (B,): 0.0},     # c_1 = 0.8; c_2 = 0.9 after A, 0 after B
)
SPS_APPENDIX = SPSTable((1.0, 0.5, 0.45))


def _p_first_is_a(schedule) -> Fraction:
    dist = _output_distribution([APPENDIX_REQ], schedule, gamma=2, vocab=2, m=1)
    assert sum(dist.values()) == 1
    return dist.get(((A,),), Fraction(0))  # key: one m-token output tuple per request


def _global_search(conf: list[list[float]]) -> list[int]:
    """The biased global search of Appendix A: pick the l maximising Theta(l) = (1 + a_1 + ... +
    a_l) * SPS(1 + l) over all l, looking at c_2 (computed from x_1) when deciding about x_1.

    After A: Theta(0) = 1, Theta(1) = 1.8 * 0.5 = 0.9, Theta(2) = (1.8 + 0.72) * 0.45 = 1.134 -> 2.
    After B: Theta(0) = 1, Theta(1) = 0.9, Theta(2) = 1.8 * 0.45 = 0.81 -> 0.
    So x_1 is verified exactly when x_1 = A: P(A) = 0.5 * 1 (A is always accepted, p_t > p_d)
    + 0.5 * 0.7 (B -> target-only step) = 0.85.
    """
    (a_row,) = prefix_survival(conf)
    theta = [(1 + sum(a_row[:l])) * SPS_APPENDIX.sps(1 + l) for l in range(len(a_row) + 1)]
    return [max(range(len(theta)), key=theta.__getitem__)]


def test_appendix_a_global_search_is_biased():
    assert _global_search([[0.8, 0.9]]) == [2] and _global_search([[0.8, 0.0]]) == [0]
    assert _p_first_is_a(_global_search) == Fraction(17, 20)          # 0.85, not 0.7
    # the same bias from the async variant fed the current confidences as "stale" ones
    # (full search over the current draft): K = 3 after A, K = 1 after B
    assert _p_first_is_a(lambda c: async_schedule(c, c, SPS_APPENDIX)) == Fraction(17, 20)


def test_appendix_a_dspark_is_lossless():
    # Algorithm 1: start Theta = 1 * 1.0 = 1; (0,1): B=2 tau=1.8 Theta = 0.9 <= 1 -> stop.
    # The decision l = 0 is made before c_2 is ever looked at, whatever x_1 is.
    assert dspark_schedule([[0.8, 0.9]], SPS_APPENDIX) == [0]
    assert dspark_schedule([[0.8, 0.0]], SPS_APPENDIX) == [0]
    assert _p_first_is_a(lambda c: dspark_schedule(c, SPS_APPENDIX)) == Fraction(7, 10)


SPS_APPENDIX_VERIFY = SPSTable((1.0, 0.6, 0.45))   # now Theta(1) = 1.08 > 1: x_1 is verified


@pytest.mark.parametrize("name, schedule", [
    ("dspark", lambda c: dspark_schedule(c, SPS_APPENDIX)),
    ("dspark_verify", lambda c: dspark_schedule(c, SPS_APPENDIX_VERIFY)),
    ("static_0.5", lambda c: static_threshold_schedule(c, 0.5)),    # l = 2 after A, 1 after B
    ("static_0.85", lambda c: static_threshold_schedule(c, 0.85)),  # l = 0
    ("fixed_1", make_scheduler("fixed", num_speculative_tokens=1)),
    ("fixed_2", make_scheduler("fixed", num_speculative_tokens=2)),
    ("none", make_scheduler("none")),
    # stale confidences come from an earlier step, independent of the current x_1:
    ("async_K3", lambda c: async_schedule(c, [[0.8, 0.9]], SPS_APPENDIX)),   # l = 2 / 1
    ("async_K1", lambda c: async_schedule(c, [[0.8, 0.0]], SPS_APPENDIX)),   # l = 0
    ("async_verify", lambda c: async_schedule(c, [[0.8, 0.0]], SPS_APPENDIX_VERIFY)),
    ("async_warmup", lambda c: async_schedule(c, None, SPS_APPENDIX)),
])
def test_appendix_a_lossless_schedulers(name, schedule):
    assert _p_first_is_a(schedule) == Fraction(7, 10), name


def test_appendix_a_verify_variant_decisions():
    # with SPS(2) = 0.6: (0,1) Theta = 1.8 * 0.6 = 1.08 > 1 admit; after A (0,2) Theta =
    # 2.52 * 0.45 = 1.134 > 1.08 admit; after B a_2 = 0 is no candidate: l = 2 / 1, x_1 always
    # verified, so P(A) = 0.5 * 1 + 0.5 * (1 - 0.3 / 0.5) = 0.7
    assert dspark_schedule([[0.8, 0.9]], SPS_APPENDIX_VERIFY) == [2]
    assert dspark_schedule([[0.8, 0.0]], SPS_APPENDIX_VERIFY) == [1]


def _random_dist(rng: random.Random, vocab: int) -> tuple[Fraction, ...]:
    weights = [rng.randint(0, 4) for _ in range(vocab)]
    if not any(weights):
        weights[rng.randrange(vocab)] = 1
    return tuple(Fraction(w, sum(weights)) for w in weights)


def _random_instance(seed: int):
    """A small exact instance; sizes keep the enumeration to <= 81 draft combinations."""
    rng = random.Random(seed)
    num_requests, gamma, vocab = [(1, 3, 3), (2, 2, 2), (2, 3, 2), (3, 2, 2), (1, 2, 3),
                                  (2, 2, 3)][seed % 6]
    m = 2                                              # first two output tokens per request
    prefixes = [p for n in range(max(gamma, m)) for p in itertools.product(range(vocab), repeat=n)]
    reqs = [_Request(p_t={p: _random_dist(rng, vocab) for p in prefixes if len(p) < m},
                     p_d={p: _random_dist(rng, vocab) for p in prefixes if len(p) < gamma},
                     conf={p: _conf_value(rng, not p) for p in prefixes if len(p) < gamma})
            for _ in range(num_requests)]
    sps = _random_sps(rng, rng.randint(num_requests + 1, num_requests * (gamma + 1) + 1))
    return rng, reqs, gamma, vocab, m, sps


NUM_RANDOM_INSTANCES = 30


def test_random_instances_exactly_lossless():
    """First two output tokens of every request, jointly, equal target-only sampling exactly, for
    every lossless scheduler. Coverage guard: in enough instances Algorithm 1's plan must actually
    change with the sampled drafts, else the check would be vacuous."""
    varied = collections.Counter()
    for seed in range(NUM_RANDOM_INSTANCES):
        rng, reqs, gamma, vocab, m, sps = _random_instance(seed)
        target = _nonzero(_target_distribution(reqs, vocab, m))
        for name, sched in _lossless_schedulers(rng, sps, gamma).items():
            plans = set()

            def recording(conf, sched=sched, plans=plans):
                lengths = sched(conf)
                plans.add(tuple(lengths))
                return lengths

            got = _nonzero(_output_distribution(reqs, recording, gamma, vocab, m))
            assert got == target, (seed, name)
            varied[name] += len(plans) > 1
    assert varied["dspark"] >= NUM_RANDOM_INSTANCES // 5, varied
    # the filled plans, too, change with the sampled drafts in enough instances
    for name in ("dspark_reach_filled", "dspark_jagged_reach_filled", "dspark_jagged_filled"):
        assert varied[name] >= NUM_RANDOM_INSTANCES // 5, (name, varied)


def test_random_instances_detect_a_peeking_rule():
    """The exact check has teeth: a rule that reads c_2 (from x_1) to decide about x_1 is caught."""
    biased = 0
    for seed in range(NUM_RANDOM_INSTANCES):
        _, reqs, gamma, vocab, m, _ = _random_instance(seed)
        got = _nonzero(_output_distribution(reqs, _peeking_schedule, gamma, vocab, m))
        biased += got != _nonzero(_target_distribution(reqs, vocab, m))
    assert biased >= NUM_RANDOM_INSTANCES // 2, biased
