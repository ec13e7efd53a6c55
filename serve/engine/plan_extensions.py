"""Extensions of a confidence plan (the lengths a scheduler of ``serve/engine/scheduler.py``
chose): :func:`hold_speed_floors` verifies more for requests predicted below their per-user speed
floor, :func:`fill_pass` fills a target pass up to a faster measured batch size. Both only
lengthen contiguous prefixes in Algorithm 1's candidate order, so a lossless plan stays lossless
(each docstring says why); ``tests/unit/test_scheduler.py`` checks them by exact enumeration.
"""

from __future__ import annotations

from collections.abc import Sequence

from .scheduler import Confidences, SPSTable, _as_rows, _batch_limit, _survival


def hold_speed_floors(confidences: Confidences, lengths: Sequence[int], sps: SPSTable,
                      floors: Sequence[float | None], max_batch_tokens: int | None = None,
                      fixed_s: float = 0.0, per_token_s: float = 0.0) -> list[int]:
    """Extend a plan so that requests below their per-user speed floor get verification first.

    A request's predicted speed is E_r / (1 / SPS(B) + ``fixed_s`` + ``per_token_s`` x B)
    tokens/s, E_r = 1 + sum_{j<=l_r} a_{r,j} its expected committed tokens per step, B = R +
    sum_r l_r. Starting from ``lengths`` (a throughput plan, e.g. :func:`dspark_schedule`'s),
    repeatedly take the request furthest below its floor (lowest speed / floor; ties: smaller r)
    and verify its next draft token, while that raises its own predicted speed and leaves every
    request that holds its floor now at or above it; a request that cannot be helped so (no
    draft left, no gain, or a cost to another's floor) is left as it is and the next one is
    tried, up to the batch limit. Requests the plan cannot lift stay below: the engine's admission keeps new
    requests waiting then (``EngineConfig.min_tokens_per_s``).

    Lossless on top of a lossless plan: it only extends contiguous prefixes, one token at a time,
    and the decision to verify x_{r,k} reads a_{r,<=k} (computed from x_{r,<k}) and the admitted
    prefixes of the other requests, never a_{r,j>k}; as with Algorithm 1's early stop, a stop
    reads only candidates whose prefixes are admitted.

    Args:
        confidences: R rows of calibrated c_{r,1..K_r} in [0, 1].
        lengths: the plan to extend, l_r in [0, K_r] (not mutated).
        sps: profiled SPS table (steps/s).
        floors: per request its floor in tokens/s, or None (no floor).
        max_batch_tokens: optional cap on B in tokens.
        fixed_s: seconds of the step beyond the target pass (the drafter call, the rest the
            engine measured); 0 = the pass alone.
        per_token_s: seconds the step's rest grows by per token of B.
    Returns:
        l: list[int] of length R with l_r >= lengths[r].
    Raises:
        ValueError: a confidence outside [0, 1], or ``lengths`` / ``floors`` not of length R.
    Source: this project's SLA extension of DSpark Algorithm 1 (issue 24; the paper reports
    throughput at a per-user speed floor, section 5).
    """
    rows = _as_rows(confidences)
    num_requests = len(rows)
    if len(lengths) != num_requests or len(floors) != num_requests:
        raise ValueError(f"{num_requests} confidence rows but {len(lengths)} lengths and "
                         f"{len(floors)} floors")
    lengths = [int(l) for l in lengths]
    limit = _batch_limit(sps, max_batch_tokens)
    batch = num_requests + sum(lengths)
    if num_requests == 0 or batch > limit or all(f is None for f in floors):
        return lengths
    a_rows = _survival(rows)
    expected = [1.0 + sum(a_rows[r][:lengths[r]]) for r in range(num_requests)]
    stuck: set[int] = set()  # requests that cannot be lifted further this step
    while batch < limit:
        # steps/s of the whole step at B and B + 1 tokens
        now = 1.0 / (1.0 / sps.sps(batch) + fixed_s + per_token_s * batch)
        nxt = 1.0 / (1.0 / sps.sps(batch + 1) + fixed_s + per_token_s * (batch + 1))
        below = [r for r in range(num_requests) if r not in stuck
                 and floors[r] is not None and expected[r] * now < floors[r]]
        if not below:
            break
        r = min(below, key=lambda q: (expected[q] * now / floors[q], q))
        k = lengths[r]
        gain = a_rows[r][k] if k < len(a_rows[r]) else 0.0
        # no draft left, one that would not raise its own speed, or one that would take a
        # request holding its floor below it: leave this request and help the next one
        if (gain <= 0.0 or not (expected[r] + gain) * nxt > expected[r] * now
                or any(q != r and floors[q] is not None
                       and expected[q] * now >= floors[q] > expected[q] * nxt
                       for q in range(num_requests))):
            stuck.add(r)
            continue
        lengths[r], expected[r], batch = k + 1, expected[r] + gain, batch + 1
    return lengths


def fill_pass(confidences: Confidences, lengths: Sequence[int], sps: SPSTable,
              max_batch_tokens: int | None = None) -> list[int]:
    """Verify more draft tokens when a longer target pass runs faster than the scheduled one.

    With B = R + sum_r l_r the scheduled pass, and A the draft tokens proposed but not scheduled,
    the pass is filled to the B* in [B, min(B + A, limit)] of largest measured SPS(B*) (ties: the
    shorter), by admitting the next B* - B candidates of Algorithm 1's order (a descending, ties
    smaller j then smaller r; candidates with a = 0 last, in the same tie order) that are not yet
    admitted. A measured SPS(B) that is jagged (``SPSTable.padded``) makes this pay: more
    tokens verified in less time. On a non-increasing table B* = B and nothing changes.

    Lossless on top of a base plan whose whole length vector, whenever it leaves x_{r,k} out
    (l_r < k), does not depend on a_{r,j>k}: true of Algorithm 1, the asynchronous variant and
    their floor extension (their candidates are read in a fixed order and a_{r,j>k} ranks after
    (r, k)), not of every lossless rule (one may verify x_{r,k} or not losslessly and still let
    another request's length read a_{r,k+1}). Then B and A (proposed tokens, fixed before
    drafting) are functions of what x_{r,<k} decides, and whether (r, k) is among the next
    B* - B candidates depends on a_{r,k} (computed from x_{r,<k}) and on other requests only,
    as in :func:`async_schedule`.

    Args:
        confidences: R rows of calibrated c_{r,1..K_r} in [0, 1].
        lengths: the plan to fill, l_r in [0, K_r] (not mutated).
        sps: the measured SPS table (steps/s), not a padded one.
        max_batch_tokens: optional cap on the pass in tokens.
    Returns:
        l: list[int] of length R with l_r >= lengths[r], sum_r (1 + l_r) = B*.
    Raises:
        ValueError: a confidence outside [0, 1], ``lengths`` not of length R or outside
            [0, K_r].
    Source: this project's extension of DSpark Algorithm 1 for jagged CPU profiles (issue 41).
    """
    rows = _as_rows(confidences)
    num_requests = len(rows)
    if len(lengths) != num_requests:
        raise ValueError(f"{num_requests} confidence rows but {len(lengths)} lengths")
    lengths = [int(l) for l in lengths]
    if any(not 0 <= l <= len(row) for l, row in zip(lengths, rows)):
        raise ValueError(f"lengths {lengths} outside [0, K_r] for rows of {[len(r) for r in rows]}")
    limit = _batch_limit(sps, max_batch_tokens)
    batch = num_requests + sum(lengths)
    spare = sum(len(row) for row in rows) - sum(lengths)
    if num_requests == 0 or batch > limit or spare == 0:
        return lengths
    reach = min(limit, batch + spare)
    best = max(range(batch, reach + 1), key=lambda b: (sps.sps(b), -b))
    order = sorted(((a, j, r) for r, row in enumerate(_survival(rows))
                    for j, a in enumerate(row, start=1)),
                   key=lambda t: (-t[0], t[1], t[2]))
    for _, j, r in order:
        if batch == best:
            break
        if j > lengths[r]:  # its prefix is admitted: (r, j - 1) came earlier in this order
            assert lengths[r] == j - 1, "the fill must keep per-request prefixes contiguous"
            lengths[r], batch = j, batch + 1
    return lengths
