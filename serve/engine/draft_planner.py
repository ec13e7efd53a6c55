"""Which requests to draft for, how many tokens, and from which source, before anything is drafted:
the goodput model with the drafter's cost in it.

Algorithm 1 (``serve/engine/scheduler.py``) maximises tau * SPS(B) over the drafts it is given, but
the drafts are already paid for when it runs. On hardware where a draft round costs a sizeable share
of a verification (a 2-core CPU: ~9 ms against ~45 ms), drafting for a request that will accept
nothing makes the step slower than a target-only step. The planner therefore predicts each request's
per-token acceptance alpha from its past rounds only and picks the drafting plan that maximises the
expected tokens per second of the whole step:

    Theta = (R + sum_r sum_{j <= l_r} alpha_r^j) / (1 / SPS(B) + T_draft(rows, K)),

where l_r is what Algorithm 1 would verify under the predicted confidences, B = R + sum_r l_r and
T_draft is the profiled drafter cost (:class:`DraftCostTable`) for the requests drafted for, K the
longest ``num_draft_tokens`` among them. A request may instead verify a prompt-lookup draft
(``serve/engine/lookup.py``), which costs nothing to propose: it is used when its predicted
accepted length is at least the drafter's.

Losslessness: the plan is a function of past steps only (earlier confidences, acceptances and
committed tokens), never of this step's drafts, so it is like choosing the draft length (the
paper's gamma) before drafting.
A request the plan keeps from the drafter is still drafted for now and then (a probe, with
exponential back-off) so that a recovering confidence is noticed. Probes are paid from a budget
(a share of decode time, ``engine.probe_budget``): due probes whose extra drafter cost exceeds what
the budget holds wait and are drafted together once it does, so under load a step that verifies
nothing costs what a target-only step costs, plus at most that share.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from .scheduler import SPSTable, dspark_schedule

Source = Literal["model", "lookup"]


# ----------------------------------------------------------------------------- drafter cost
@dataclass(frozen=True, slots=True)
class DraftCostTable:
    """Profiled seconds of one batched drafter call (context extension included) by the number of
    requests drafted for (rows) and the draft tokens per row (``num_draft_tokens``, the longest
    row's), greedy and sampled.

    Cost is affine in num_draft_tokens (one parallel block pass plus one head step per drafted
    token), so it is measured at 1 and at ``block_size`` and interpolated in between; rows are
    interpolated linearly between measured sizes and clamped beyond them.

    A request whose context has fallen behind (its prompt before its first draft, or the tokens
    committed while the planner skipped it) is extended by more than the 2 positions the table
    includes; each further position costs ``extend_s_per_position``.

    Args:
        rows: measured row counts, ascending, starting at 1.
        greedy_s, sampled_s: per row count, (seconds drafting 1 token, seconds drafting
            block_size tokens).
        block_size: the longest draft measured (the drafter's block_size).
        extend_s_per_position: seconds per context position beyond 2 (one row extended by many).
    Raises:
        ValueError: empty or unsorted rows, mismatched lengths, a non-finite or negative time.
    """

    rows: tuple[int, ...]
    greedy_s: tuple[tuple[float, float], ...]
    sampled_s: tuple[tuple[float, float], ...]
    block_size: int
    extend_s_per_position: float = 0.0

    def __post_init__(self) -> None:
        if not self.rows or self.rows[0] != 1 or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"draft cost rows must be ascending and start at 1, got {self.rows}")
        if not (math.isfinite(self.extend_s_per_position) and self.extend_s_per_position >= 0):
            raise ValueError(f"extend_s_per_position must be finite and >= 0, got "
                             f"{self.extend_s_per_position}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("greedy_s", "sampled_s"):
            values = getattr(self, name)
            if len(values) != len(self.rows):
                raise ValueError(f"{name} has {len(values)} entries for {len(self.rows)} row sizes")
            for pair in values:
                if len(pair) != 2 or not all(math.isfinite(v) and v >= 0 for v in pair):
                    raise ValueError(f"{name} entries must be two finite seconds >= 0, got {pair}")

    def seconds(self, rows: int, num_draft_tokens: int, sampled: bool) -> float:
        """Predicted seconds of one drafter call for ``rows`` requests drafting (at most)
        ``num_draft_tokens`` tokens each (0 when either is 0)."""
        if rows <= 0 or num_draft_tokens <= 0:
            return 0.0
        table = self.sampled_s if sampled else self.greedy_s
        i = bisect.bisect_left(self.rows, rows)
        if i >= len(self.rows):
            lo = hi = table[-1]
            w = 0.0
        elif self.rows[i] == rows or i == 0:
            lo = hi = table[i]
            w = 0.0
        else:
            lo, hi = table[i - 1], table[i]
            w = (rows - self.rows[i - 1]) / (self.rows[i] - self.rows[i - 1])
        at = [(1 - w) * a + w * b for a, b in zip(lo, hi)]
        if self.block_size == 1:
            return at[0]
        frac = (min(num_draft_tokens, self.block_size) - 1) / (self.block_size - 1)
        return at[0] + frac * (at[1] - at[0])

    def scaled(self, factor: float) -> DraftCostTable:
        """This table with every time multiplied by ``factor`` (> 0): a correction from the
        engine's measured calls (``serve/engine/cost_check.py``)."""
        times = lambda table: tuple((a * factor, b * factor) for a, b in table)
        return DraftCostTable(self.rows, times(self.greedy_s), times(self.sampled_s),
                              self.block_size, self.extend_s_per_position * factor)

    def backlog_seconds(self, pending: int) -> float:
        """Extra seconds to extend one row's context by ``pending`` positions (beyond the 2 the
        table includes)."""
        return max(0, pending - 2) * self.extend_s_per_position

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (seconds)."""
        return {"unit": "seconds", "rows": list(self.rows), "block_size": self.block_size,
                "greedy_s": [list(p) for p in self.greedy_s],
                "sampled_s": [list(p) for p in self.sampled_s],
                "extend_s_per_position": self.extend_s_per_position}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DraftCostTable:
        """Inverse of :meth:`to_dict`; also reads the tables stored before ``block_size`` was
        named so (key ``max_depth``).

        Raises:
            ValueError: missing keys or bad values.
        """
        try:
            return cls(tuple(int(r) for r in data["rows"]),
                       tuple(tuple(float(v) for v in p) for p in data["greedy_s"]),
                       tuple(tuple(float(v) for v in p) for p in data["sampled_s"]),
                       int(data["block_size"] if "block_size" in data else data["max_depth"]),
                       float(data.get("extend_s_per_position", 0.0)))
        except (KeyError, TypeError) as err:
            raise ValueError(f"bad draft cost table: {err!r}") from None


# ----------------------------------------------------------------------------- acceptance
@dataclass(slots=True)
class AcceptanceEstimate:
    """A request's per-token acceptance alpha for one draft source, from its past rounds: a
    Beta(prior * weight, (1 - prior) * weight) prior updated with exponentially discounted counts
    (recent rounds matter more: acceptance drifts within a response).

    successes / trials may be fractional (expected counts from calibrated confidences).
    """

    prior: float = 0.5
    weight: float = 2.0
    decay: float = 0.8
    successes: float = 0.0
    trials: float = 0.0

    @property
    def alpha(self) -> float:
        """Predicted probability that a draft token survives, given its prefix did."""
        return (self.successes + self.prior * self.weight) / (self.trials + self.weight)

    def update(self, successes: float, trials: float) -> None:
        self.successes = self.decay * self.successes + successes
        self.trials = self.decay * self.trials + trials


def expected_accepted(alpha: float, num_draft_tokens: int) -> float:
    """sum_{j=1..num_draft_tokens} alpha^j: expected accepted tokens of a draft of
    ``num_draft_tokens`` tokens whose tokens survive with probability alpha each given their
    prefix did."""
    return sum(alpha ** j for j in range(1, num_draft_tokens + 1))


# ----------------------------------------------------------------------------- the plan
@dataclass(slots=True)
class RequestOptions:
    """What one request could verify this step.

    cap: the most draft tokens it may verify (budget, num_speculative_tokens, drafter context);
    model_alpha: predicted per-token acceptance of the drafter (None: the drafter cannot draft for
    it);
    lookup_len / lookup_alpha: length and predicted acceptance of its prompt-lookup draft
    (0: no match); probe_due: the drafter must draft for it this step (a lossless probe);
    pending: committed positions not yet in its drafter context (extended before it is drafted).
    """

    cap: int
    model_alpha: float | None
    lookup_len: int = 0
    lookup_alpha: float = 0.0
    probe_due: bool = False
    pending: int = 0


@dataclass(slots=True)
class DraftPlan:
    """Per request: source ("model", "lookup" or None), its num_draft_tokens (tokens to
    propose), for lookup rows the predicted confidences handed to the verification scheduler, and
    whether a drafter row is drafted only as a probe; plus the predicted step goodput (tokens/s)
    with and without drafting, for the logs and tests, and the predicted seconds the probes add
    to the drafter call (what the probe budget pays)."""

    sources: list[Source | None] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
    lookup_confidences: list[list[float]] = field(default_factory=list)
    probed: list[bool] = field(default_factory=list)
    predicted_tps: float = 0.0
    predicted_tps_without_drafter: float = 0.0
    probe_cost_s: float = 0.0
    # per request the verification length the plan predicts (Algorithm 1 on the predicted
    # confidences; 0: not drafted for, or drafted only as a probe)
    predicted_lengths: list[int] = field(default_factory=list)


def plan_drafts(options: list[RequestOptions], sps: SPSTable, draft_cost: DraftCostTable | None,
                sampled: bool, max_batch_tokens: int | None = None,
                probe_allowance_s: float = math.inf, min_gain: float = 0.0,
                probe_alpha: float = 1.0, fills: bool = False) -> DraftPlan:
    """Choose, for every request, whether the drafter drafts for it and how many tokens, or
    whether it verifies its prompt-lookup draft, maximising the predicted goodput of the whole
    step.

    1. Source: lookup when its predicted accepted length is at least the drafter's at the same cap.
    2. Predicted verification lengths l_r: Algorithm 1 on the predicted confidences (alpha_r
       repeated), under the same SPS table and token budget as the real verification.
    3. The drafter rows kept are those of largest predicted gain, as many as maximise Theta
       (module docstring; every cut is evaluated); the drafter cost is that of the rows kept.
       Unless that Theta beats drafting for nobody by the fraction ``min_gain``, nobody is
       drafted for (the margin covers what the cost model leaves out).
    4. A kept drafter row drafts l_r + 1 tokens (one beyond the prediction, so Algorithm 1 can
       verify deeper when this step's confidences are higher), capped at ``cap``; a probe drafts
       at least one. With ``fills`` (passes filled to a faster length, ``fill_pass``) every kept
       row drafts as many more as filling the pass to its fastest length needs, and each plan is
       valued at the speed its own drafts can reach (the measured SPS(B)'s upper envelope up to
       the pass its proposed tokens allow, ``SPSTable.padded``): never at a speed that drafts it
       does not propose would be needed for.
    5. The due probes are drafted (all together) when a request accepting ``probe_alpha`` of
       its draft tokens would be kept at this step's batch, valued as the cuts are (with
       ``fills``: at the speed its pass can reach), and what they add to the drafter call's
       cost is within ``probe_allowance_s``; otherwise none is, and they stay due. (When no
       such request would be kept, no probe result could change the plan: under load on a CPU
       the verification a draft adds costs more than even a well-predicted draft returns.)

    Args:
        options: one :class:`RequestOptions` per running request.
        sps: the measured SPS(B) table (steps/s).
        draft_cost: the drafter's cost table; None = drafting is free.
        sampled: whether any request samples (temperature > 0): picks the cost column.
        max_batch_tokens: token budget of the step.
        probe_allowance_s: seconds of drafter time the probes may add this step (the engine's
            probe budget); inf = probes are always drafted when due.
        min_gain: the relative goodput gain a plan that drafts must promise (0 = any gain).
        probe_alpha: the per-token acceptance a probed request is credited with when asking
            whether any probe result could pay this step (1.0 = probe whenever a perfect draft
            would pay).
        fills: whether the engine fills each target pass (``engine.fill_passes``).
    Returns:
        a :class:`DraftPlan`.
    Source: DSpark paper section 3.2.2 (goodput tau * SPS(B)), extended with the drafting time.
    """
    n = len(options)
    plan = DraftPlan([None] * n, [0] * n, [[] for _ in range(n)], [False] * n)
    if n == 0:
        return plan
    preds: list[list[float]] = []
    for i, o in enumerate(options):
        model_value = (expected_accepted(o.model_alpha, o.cap)
                       if o.model_alpha is not None and o.cap > 0 else -1.0)
        look_len = min(o.lookup_len, o.cap)
        if look_len > 0 and expected_accepted(o.lookup_alpha, look_len) >= model_value:
            plan.sources[i] = "lookup"
            preds.append([o.lookup_alpha] * look_len)
        elif model_value >= 0:
            plan.sources[i] = "model"
            preds.append([o.model_alpha] * o.cap)
        else:
            preds.append([])
    # predicted confidences must be valid probabilities for Algorithm 1
    preds = [[min(max(c, 0.0), 1.0) for c in row] for row in preds]
    limit = sps.max_tokens if max_batch_tokens is None else min(sps.max_tokens, max_batch_tokens)
    # with fills: the envelope up to every request proposing its whole cap (lookup: its match),
    # the widest reach a plan can have; serve/engine/step_plan.py schedules on the envelope up to
    # what was really proposed, and each cut below is valued at its own reach
    planning = (sps.padded(max(1, min(limit, n + sum(len(row) for row in preds)))) if fills
                else sps)
    lengths = dspark_schedule(preds, planning, max_batch_tokens)
    alphas = [row[0] if row else 0.0 for row in preds]
    lookup_rows = [(alphas[i], lengths[i]) for i in range(n) if plan.sources[i] == "lookup"]
    model_rows = sorted((i for i in range(n) if plan.sources[i] == "model" and lengths[i] > 0),
                        key=lambda i: expected_accepted(alphas[i], lengths[i]))
    probes = [i for i in range(n) if plan.sources[i] == "model" and options[i].probe_due]

    def fill_extra(batch: int) -> int:
        """Draft tokens per kept row beyond l_r + 1 that filling a pass of ``batch`` scheduled
        tokens to its fastest length needs (0 without fills)."""
        return planning.fill_target(batch) - batch if fills and 1 <= batch <= limit else 0

    def drafts(i: int, extra: int) -> int:
        """Draft tokens drafter row i proposes: one beyond its predicted length (a probe: at
        least one), ``extra`` more to fill the pass, at most its cap."""
        return min(options[i].cap, max(1, lengths[i] + 1 + extra))

    def speed(batch: int, reach: int) -> float:
        """SPS of a pass scheduled at ``batch`` tokens whose proposals allow ``reach``."""
        if not fills:
            return sps.sps(batch)
        return max(sps.sps(b) for b in range(batch, max(batch, min(reach, limit)) + 1))

    # the economic decision ignores probes: they are paid from the probe budget (below), and a
    # row kept only because its probe was paid for anyway would never let the back-off grow.
    # Every cut is evaluated (keep the rows of largest predicted gain, drop the rest), not a
    # greedy one-at-a-time descent: a drafter call has a fixed cost, so dropping one row of
    # many saves little and only dropping them all pays (measured: a greedy descent kept four
    # hopeless rows for ever).
    m = len(model_rows)
    gain_suffix, len_suffix = [0.0] * (m + 1), [0] * (m + 1)
    backlog_suffix = [0.0] * (m + 1)
    # without a fill: the longest draft and the drafts proposed by the rows kept at each cut
    longest_suffix, proposed_suffix = [0] * (m + 1), [0] * (m + 1)
    for k in range(m - 1, -1, -1):
        i = model_rows[k]
        gain_suffix[k] = gain_suffix[k + 1] + expected_accepted(alphas[i], lengths[i])
        backlog_suffix[k] = backlog_suffix[k + 1] + (
            draft_cost.backlog_seconds(options[i].pending) if draft_cost else 0.0)
        len_suffix[k] = len_suffix[k + 1] + lengths[i]
        longest_suffix[k] = max(longest_suffix[k + 1], drafts(i, 0))
        proposed_suffix[k] = proposed_suffix[k + 1] + drafts(i, 0)
    look_tokens = sum(expected_accepted(a, l) for a, l in lookup_rows)
    look_len = sum(l for _, l in lookup_rows)
    # lookup rows propose their whole match: what is not predicted verified can fill the pass
    look_spare = sum(len(preds[i]) - lengths[i] for i in range(n) if plan.sources[i] == "lookup")

    best, cut, value = -1.0, m, 0.0
    for k in range(m + 1):  # keep model_rows[k:]
        batch = n + look_len + len_suffix[k]
        extra = fill_extra(batch)
        if extra:  # O(m) only where a fill is wanted
            proposed = [drafts(i, extra) for i in model_rows[k:]]
            longest, total = max(proposed, default=0), sum(proposed)
        else:
            longest, total = longest_suffix[k], proposed_suffix[k]
        cost = (draft_cost.seconds(m - k, longest, sampled)
                + backlog_suffix[k] if draft_cost else 0.0)
        reach = batch + look_spare + total - len_suffix[k]
        value = (0.0 if batch > limit else
                 (n + look_tokens + gain_suffix[k]) / (1.0 / speed(batch, reach) + cost))
        if value >= best:  # ties drop rows: the cheaper plan
            best, cut = value, k
    if cut < m and best < (1.0 + min_gain) * value:  # value: the last cut, nobody drafted
        best, cut = value, m
    kept = model_rows[cut:]
    fill_tokens = fill_extra(n + look_len + len_suffix[cut]) if kept else 0
    plan.predicted_tps = best
    plan.predicted_tps_without_drafter = value  # the last cut: nobody drafted
    kept_set = set(kept)
    probes = [i for i in probes if i not in kept_set]
    if probes and draft_cost is not None:
        # could a probe's answer matter now? Only if a request drafting at probe_alpha would be
        # kept beside the plan's rows (its best length, the cheapest backlog among the probes)
        longest = max(options[i].cap for i in probes)
        backlog = min(draft_cost.backlog_seconds(options[i].pending) for i in probes)
        could_pay = False
        kept_proposals = [drafts(i, fill_tokens) for i in kept]
        kept_tokens = max(kept_proposals, default=0)
        # the kept rows' and lookups' proposals beyond their predicted lengths: with fills the
        # pass can reach that far, and the plan's cuts were valued at that reach too
        spare = look_spare + sum(kept_proposals) - len_suffix[cut]
        for l in range(1, longest + 1):
            batch = n + look_len + len_suffix[cut] + l
            if batch > limit:
                break
            probe_tokens = min(longest, l + 1)
            cost = (draft_cost.seconds(m - cut + 1, max(kept_tokens, probe_tokens), sampled)
                    + backlog_suffix[cut] + backlog)
            reach = batch + spare + probe_tokens - l
            with_probe = ((n + look_tokens + gain_suffix[cut] + expected_accepted(probe_alpha, l))
                          / (1.0 / speed(batch, reach) + cost))
            if with_probe > best and with_probe >= (1.0 + min_gain) * value:
                could_pay = True
                break
        if not could_pay:
            probes = []  # they stay due: probed once the load makes a good draft pay again

    if probes and draft_cost is not None:
        def call_s(rows: list[int]) -> float:
            num_draft_tokens = max((drafts(i, fill_tokens if i in kept_set else 0)
                                    for i in rows), default=0)
            return (draft_cost.seconds(len(rows), num_draft_tokens, sampled)
                    + sum(draft_cost.backlog_seconds(options[i].pending) for i in rows))

        extra = call_s(kept + probes) - call_s(kept)
        if extra > probe_allowance_s:
            probes = []  # they stay due and go together once the budget covers them
        else:
            plan.probe_cost_s = extra
    plan.predicted_lengths = [lengths[i] if plan.sources[i] == "lookup" or i in kept_set else 0
                              for i in range(n)]
    for i in range(n):
        if plan.sources[i] == "lookup":
            plan.num_draft_tokens[i] = min(options[i].lookup_len, options[i].cap)
            plan.lookup_confidences[i] = preds[i]
        elif plan.sources[i] == "model" and (i in kept_set or i in probes):
            plan.num_draft_tokens[i] = drafts(i, fill_tokens if i in kept_set else 0)
            plan.probed[i] = i not in kept_set
        else:
            plan.sources[i] = None
    return plan
