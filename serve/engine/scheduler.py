"""Verification-length schedulers: how many draft tokens l_r each active request verifies this step
(DSpark paper section 3.2.2, Algorithm 1, section 5.2 and Appendix A; SPEC section 6).

Every scheduler here is a pure function of per-request confidences: no model, no clock, no I/O, and
inputs are never mutated. It returns one int l_r in [0, K_r] per request, where K_r is the number
of draft tokens request r proposed, its ``num_draft_tokens`` (the paper's gamma_r, the draft
length; rows may have different lengths, including 0). A step then verifies B = sum_r (1 + l_r)
tokens: every request's anchor plus its l_r draft tokens. The engine finds them by name in
``serve/engine/scheduler_registry.py``; SPS(B) is ``serve/engine/sps.py``.

Terms and units (SPEC 0):
- c_{r,j} in [0, 1]: calibrated confidence that draft token j of request r survives verification
  given tokens < j were accepted. It is computed from x_{r,<j} (the Markov head embeds x_{r,j-1}).
- a_{r,j} = prod_{i<=j} c_{r,i}: prefix survival probability.
- SPS(B): target engine steps per second at a verification batch of B tokens (steps/s).
- tau = R + sum of the admitted a_{r,j}: expected committed tokens per step (bonus included).
- Theta = tau * SPS(B): expected goodput in tokens per second.

Losslessness. Rejection sampling keeps the target's distribution as long as the decision "verify
draft token x_{r,k}" (l_r >= k) is a function of x_{r,<k} and of other requests only, never of
x_{r,k} itself or of anything computed from it (c_{r,k+1}, c_{r,k+2}, ...). Algorithm 1 and the
asynchronous variant admit candidates in one fixed order (a descending, ties smaller j then
smaller r) in which (r, k) precedes every (r, j > k), and decide about (r, k) from the candidates
up to it only (plus, for the asynchronous variant, confidences of an earlier step). The order is
also what keeps requests jointly lossless: when (r, k) depends on another request's (r', j'),
that candidate ranks before (r, k), so no two decisions depend on each other. The baselines decide
from a_{r,<=k} (static threshold) or from nothing. Appendix A shows what goes wrong otherwise: a
global search that may look past (r, k) outputs token A with probability 0.85 instead of the
target's 0.7. ``tests/unit/test_scheduler.py`` checks all of this by exact enumeration.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from .sps import SPSTable  # re-exported: the schedulers' hardware profile

# Confidences: R rows of K_r floats in [0, 1]; a list of lists, a numpy array or a torch tensor
# [R, K] (anything with ``tolist()``).
Confidences = Any


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    """A verification plan and its expected value.

    lengths: l_r per request, ints in [0, K_r]; batch_tokens: B = sum_r (1 + l_r);
    expected_tokens: tau = sum_r (1 + sum_{j<=l_r} a_{r,j}), expected committed tokens per step
    (bonus included); throughput_tps: Theta = tau * SPS(B) in tokens/s, None when B is outside
    the SPS table.
    """

    lengths: list[int] = field(default_factory=list)
    batch_tokens: int = 0
    expected_tokens: float = 0.0
    throughput_tps: float | None = 0.0

    @classmethod
    def make_empty(cls) -> ScheduleResult:
        """The plan for zero active requests."""
        return cls()


def _as_rows(confidences: Confidences) -> list[list[float]]:
    """Validated copy of the confidences as R lists of floats in [0, 1]."""
    if hasattr(confidences, "tolist"):
        confidences = confidences.tolist()
    try:
        rows = [[float(c) for c in row] for row in confidences]
    except TypeError as e:
        raise ValueError("confidences must be R rows of per-position floats (e.g. [R, K]), "
                         f"got {type(confidences).__name__}: {e}") from None
    for r, row in enumerate(rows):
        for j, c in enumerate(row, start=1):
            if not 0.0 <= c <= 1.0:  # also rejects NaN
                raise ValueError(f"confidence of request {r} at draft position {j} is {c}, "
                                 "not in [0, 1]")
    return rows


def _survival(rows: list[list[float]]) -> list[list[float]]:
    out = []
    for row in rows:
        acc, a_row = 1.0, []
        for c in row:
            # c <= 1 and round-to-nearest keep the product non-increasing in j, which the
            # contiguity of admitted prefixes relies on.
            acc *= c
            a_row.append(acc)
        out.append(a_row)
    return out


def prefix_survival(confidences: Confidences) -> list[list[float]]:
    """a_{r,j} = prod_{i<=j} c_{r,i}: probability that draft tokens 1..j of request r all survive.

    Args:
        confidences: R rows, row r holding K_r calibrated confidences c_{r,1..K_r} in
            [0, 1] (rows may differ in length, including 0).
    Returns:
        R lists with the same lengths, non-increasing along each row.
    Raises:
        ValueError: a confidence outside [0, 1] or NaN.
    Source: SPEC 0 (prefix survival probability); DSpark paper Algorithm 1, line 1.
    """
    return _survival(_as_rows(confidences))


def _candidates(a_rows: list[list[float]]) -> list[tuple[float, int, int]]:
    """(a, j, r) for every a_{r,j} > 0, in admission order: a descending, then j, then r.

    Because a_{r,j} is non-increasing in j and ties go to the smaller j, (r, j) always precedes
    (r, j + 1), so admitting any prefix of this list verifies a contiguous prefix per request.
    """
    cands = [(a, j, r) for r, row in enumerate(a_rows) for j, a in enumerate(row, start=1)
             if a > 0.0]
    cands.sort(key=lambda t: (-t[0], t[1], t[2]))
    return cands


def _batch_limit(sps: SPSTable, max_batch_tokens: int | None) -> int:
    if not isinstance(sps, SPSTable):
        raise ValueError(f"sps must be an SPSTable, got {type(sps).__name__}")
    if max_batch_tokens is None:
        return sps.max_tokens
    max_batch_tokens = operator.index(max_batch_tokens)
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    return min(sps.max_tokens, max_batch_tokens)


def _admit(cands: list[tuple[float, int, int]], num_requests: int, n: int) -> list[int]:
    """Lengths after admitting the first n candidates of the admission order."""
    lengths = [0] * num_requests
    for _, j, r in cands[:max(n, 0)]:
        assert lengths[r] == j - 1, "admission order must keep per-request prefixes contiguous"
        lengths[r] = j
    return lengths


@overload
def dspark_schedule(confidences: Confidences, sps: SPSTable, max_batch_tokens: int | None = ...,
                    *, return_result: Literal[False] = ...) -> list[int]: ...


@overload
def dspark_schedule(confidences: Confidences, sps: SPSTable, max_batch_tokens: int | None = ...,
                    *, return_result: Literal[True]) -> ScheduleResult: ...


def dspark_schedule(confidences, sps, max_batch_tokens=None, *, return_result=False):
    """DSpark Algorithm 1: greedy prefix admission with early stop, maximising expected goodput.

    Candidates (r, j) with a_{r,j} > 0 are visited by a descending (ties: smaller j, then smaller
    r). Start with l = 0, B = R (every request verifies its anchor), tau* = R and
    Theta_best = R * SPS(R). For each candidate: B += 1, tau* += a_{r,j}, Theta = tau* * SPS(B);
    admit (l_r = j) if Theta > Theta_best, else stop. The scan also stops before B would exceed the
    SPS table or ``max_batch_tokens``.

    Lossless: the stop makes "verify x_{r,k}" depend only on candidates up to (r, k) in the order,
    none of which is computed from x_{r,k} (c_{r,k+1} ranks after (r, k)). A search that continues
    past a non-improving candidate would let c_{r,k+1} decide about x_{r,k} (Appendix A bias).

    With R above the batch limit (SPS table or max_batch_tokens) every request verifies 0 draft
    tokens (target-only step, lossless) and ``throughput_tps`` is None.

    Args:
        confidences: R rows of calibrated c_{r,1..K_r} in [0, 1] (list of lists, numpy array
            or torch tensor [R, K]).
        sps: profiled SPS table (steps/s).
        max_batch_tokens: optional cap on B in tokens (engine token budget).
        return_result: return a :class:`ScheduleResult` (with tau* and Theta_best in tokens/s)
            instead of the bare lengths.
    Returns:
        l: list[int] of length R, l_r in [0, K_r]; or a ScheduleResult.
    Raises:
        ValueError: a confidence outside [0, 1], sps not an SPSTable, max_batch_tokens < 1.
    Source: DSpark paper section 3.2.2, Algorithm 1; SPEC 6 steps 1-4.
    """
    rows = _as_rows(confidences)
    limit = _batch_limit(sps, max_batch_tokens)
    num_requests = len(rows)
    if num_requests == 0:
        return ScheduleResult.make_empty() if return_result else []
    if num_requests > limit:
        lengths = [0] * num_requests
        return (ScheduleResult(lengths, num_requests, float(num_requests), None)
                if return_result else lengths)
    lengths = [0] * num_requests
    batch, tau = num_requests, float(num_requests)
    theta_best = tau * sps.sps(batch)
    for a, j, r in _candidates(_survival(rows)):
        if batch + 1 > limit:
            break
        theta = (tau + a) * sps.sps(batch + 1)
        if not theta > theta_best:
            break  # early stop: keeps the decision for x_{r,j} independent of x_{r,j}
        assert lengths[r] == j - 1, "admission order must keep per-request prefixes contiguous"
        lengths[r] = j
        batch, tau, theta_best = batch + 1, tau + a, theta
    if return_result:
        return ScheduleResult(lengths, batch, tau, theta_best)
    return lengths


def full_search_capacity(confidences: Confidences, sps: SPSTable,
                         max_batch_tokens: int | None = None) -> int:
    """Best batch capacity K (tokens) over all prefixes of the Algorithm 1 order, no early stop.

    Same order and bookkeeping as :func:`dspark_schedule`, but the scan runs through every candidate
    (up to the SPS table / ``max_batch_tokens``) and keeps the prefix with the largest
    Theta = tau * SPS(B), so it can cross a jagged SPS dip to a larger, better batch. Ties keep the
    smaller K.

    Not lossless on its own: applied to the confidences of the drafts being verified, the capacity
    depends on c_{r,k+1} and thus on x_{r,k} (Appendix A). :func:`async_schedule` uses it on
    confidences from two steps earlier, which is lossless.

    Args:
        confidences: R rows of c_{r,1..K_r} in [0, 1].
        sps: profiled SPS table (steps/s).
        max_batch_tokens: optional cap on K in tokens.
    Returns:
        K: int, R <= K <= max(R, limit); K = R means no draft token. R above the limit gives R.
    Raises:
        ValueError: as :func:`dspark_schedule`.
    Source: DSpark paper section 5.2 (asynchronous scheduling, full search); SPEC 6.
    """
    rows = _as_rows(confidences)
    limit = _batch_limit(sps, max_batch_tokens)
    num_requests = len(rows)
    if num_requests == 0 or num_requests > limit:
        return num_requests
    batch, tau = num_requests, float(num_requests)
    best_k, theta_best = batch, tau * sps.sps(batch)
    for a, _, _ in _candidates(_survival(rows)):
        if batch + 1 > limit:
            break
        batch, tau = batch + 1, tau + a
        theta = tau * sps.sps(batch)
        if theta > theta_best:
            best_k, theta_best = batch, theta
    return best_k


def async_schedule(current_confidences: Confidences, stale_confidences: Confidences | None,
                   sps: SPSTable, max_batch_tokens: int | None = None) -> list[int]:
    """Asynchronous production variant: capacity from stale confidences, admission from current.

    K = :func:`full_search_capacity` over ``stale_confidences`` (the confidences of two steps
    earlier, available while the previous step still runs). Then the first K - R candidates of the
    current Algorithm 1 order (current a_{r,j} > 0; a descending, ties smaller j then smaller r)
    are admitted, R being the current number of requests. If requests joined or left since the
    stale step, R differs and the draft budget K - R shrinks or grows accordingly (never below 0).

    Lossless: K is a function of the stale confidences only, which were computed before the
    current draft tokens were sampled. Whether (r, k) is among the first K - R candidates depends
    only on the candidates ranked before it, and (r, j > k), the only ones computed from x_{r,k},
    rank after it. So "verify x_{r,k}" never depends on x_{r,k}. The caller must not pass
    confidences of the current draft as ``stale_confidences``: that is the biased global search of
    Appendix A.

    Warm-up (``stale_confidences`` is None, the first two steps of the engine): falls back to
    :func:`dspark_schedule` on the current confidences. That is lossless by Algorithm 1's early
    stop and, unlike verifying no draft tokens, does not waste the first steps; its only cost is
    that the scheduling is not hidden behind a running step.

    Args:
        current_confidences: R rows of the current c_{r,1..K_r} in [0, 1].
        stale_confidences: R' rows of the confidences two steps earlier, or None.
        sps: profiled SPS table (steps/s).
        max_batch_tokens: optional cap on B in tokens (applied to K and to the current batch).
    Returns:
        l: list[int] of length R, l_r in [0, K_r]; all zeros when R exceeds the batch limit.
    Raises:
        ValueError: as :func:`dspark_schedule`, for either set of confidences.
    Source: DSpark paper section 5.2 (asynchronous scheduling); SPEC 6.
    """
    if stale_confidences is None:
        return dspark_schedule(current_confidences, sps, max_batch_tokens)
    capacity = full_search_capacity(stale_confidences, sps, max_batch_tokens)
    rows = _as_rows(current_confidences)
    limit = _batch_limit(sps, max_batch_tokens)
    num_requests = len(rows)
    if num_requests > limit:
        return [0] * num_requests
    budget = min(capacity, limit) - num_requests
    return _admit(_candidates(_survival(rows)), num_requests, budget)


def static_threshold_schedule(confidences: Confidences, threshold: float) -> list[int]:
    """Baseline: verify the leading draft tokens whose prefix survival reaches a fixed threshold.

    l_r = number of leading positions j with a_{r,j} >= threshold (a is non-increasing in j, so this
    cuts at the first position below). Lossless: a_{r,k} is computed from x_{r,<k}. Ignores
    hardware and batch size.

    Args:
        confidences: R rows of c_{r,1..K_r} in [0, 1].
        threshold: in [0, 1]; 0 verifies every draft token.
    Returns:
        l: list[int] of length R.
    Raises:
        ValueError: threshold not in [0, 1] or NaN; a confidence outside [0, 1].
    Source: SPEC 6 (baselines: static confidence threshold).
    """
    threshold = _check_threshold(threshold)
    lengths = []
    for a_row in _survival(_as_rows(confidences)):
        n = 0
        while n < len(a_row) and a_row[n] >= threshold:
            n += 1
        lengths.append(n)
    return lengths


def _check_threshold(threshold: float) -> float:
    threshold = float(threshold)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    return threshold


def _check_num_speculative_tokens(num_speculative_tokens: int) -> int:
    num_speculative_tokens = operator.index(num_speculative_tokens)
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0 draft tokens, got "
                         f"{num_speculative_tokens}")
    return num_speculative_tokens


def fixed_schedule(num_draft_tokens: int | Sequence[int],
                   num_speculative_tokens: int) -> list[int]:
    """Baseline: every request verifies ``num_speculative_tokens`` draft tokens (the serving cap),
    clipped to the drafts it has.

    Args:
        num_draft_tokens: the draft count K_r of each request, or just the number of requests R
            (each assumed to have >= num_speculative_tokens drafts).
        num_speculative_tokens: fixed verification length, >= 0.
    Returns:
        l: list[int], l_r = min(num_speculative_tokens, K_r).
    Raises:
        ValueError: num_speculative_tokens < 0, R < 0 or a negative K_r.
    Source: SPEC 6 (baselines: fixed length).
    """
    num_speculative_tokens = _check_num_speculative_tokens(num_speculative_tokens)
    if hasattr(num_draft_tokens, "tolist"):  # numpy array / torch tensor of counts, or a 0-d count
        num_draft_tokens = num_draft_tokens.tolist()
    if isinstance(num_draft_tokens, Sequence):
        available = [operator.index(k) for k in num_draft_tokens]
        if any(k < 0 for k in available):
            raise ValueError(f"available draft counts must be >= 0, got {available}")
        return [min(num_speculative_tokens, k) for k in available]
    num_requests = operator.index(num_draft_tokens)
    if num_requests < 0:
        raise ValueError(f"number of requests must be >= 0, got {num_requests}")
    return [num_speculative_tokens] * num_requests


def no_speculation_schedule(num_requests: int) -> list[int]:
    """Baseline: target-only decoding, l_r = 0 for all R requests.

    Raises:
        ValueError: num_requests < 0.
    Source: SPEC 6 (baselines: no speculation).
    """
    num_requests = operator.index(num_requests)
    if num_requests < 0:
        raise ValueError(f"number of requests must be >= 0, got {num_requests}")
    return [0] * num_requests
