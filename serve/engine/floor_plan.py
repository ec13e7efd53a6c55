"""Drafting for the requests at risk of their per-user speed floor (issue 43.1).

The goodput planner (``serve/engine/draft_planner.py``) maximises the step's aggregate
tokens/s: under load on a CPU it often drafts for nobody, and then the verification scheduler's
floor extension (``plan_extensions.hold_speed_floors``) has no draft to lengthen. Given per-request
floors, :func:`plan_for_floors` chooses the drafting once more: among the goodput plan and plans
that also draft for the requests below their floor (or for every request with a floor), at one
common length, with the other requests' drafts kept or dropped, and drafting for nobody, the one
that maximises the worst request's predicted speed relative to its floor
(capped at the floor: above it only throughput counts), then the predicted throughput. So a
request with slack costs nothing, a request at risk gets a draft when drafting raises it, and
nobody is drafted for where drafting cannot pay.

A request's predicted speed is E_r / T tokens/s: E_r = 1 + its expected accepted draft tokens
(its predicted per-token acceptance alpha_r, ``expected_accepted``), T = the target pass of the
step's B tokens (``SPSTable.pass_seconds``) + the drafter call (``DraftCostTable``) + the rest of a
step the engine measured (sampling, verification, commit, prompt chunks riding, the serving
threads' turns), a fixed part plus a part per verified token (:class:`StepRest`): with one
figure for every plan, plans that verify more were predicted fast (measured at 8 streams: request
floors doubled the verification budget and the per-user speed did not move). It reads only the past
(acceptance estimates, profiles): lossless as the goodput plan is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .draft_planner import DraftCostTable, DraftPlan, RequestOptions, expected_accepted
from .sps import SPSTable


@dataclass(frozen=True, slots=True)
class FloorRow:
    """One running request as the floor plan sees it.

    floor: its per-user speed floor in tokens/s (None: none);
    alpha: the drafter's predicted per-token acceptance for it (None: the drafter does not draft
    for it: no cap, or a lookup draft was chosen);
    cap: the most draft tokens it may verify;
    length: the verification length the goodput plan predicts for it (0: not drafted for);
    fixed_tokens: tokens it verifies whatever the drafter does (1 + a lookup draft's length);
    fixed_gain: expected tokens it commits whatever the drafter does (1 + the lookup's expected
    accepted);
    backlog_s: seconds its drafter context extension adds to the drafter call.
    """

    floor: float | None
    alpha: float | None
    cap: int
    length: int
    fixed_tokens: int = 1
    fixed_gain: float = 1.0
    backlog_s: float = 0.0


@dataclass(slots=True)
class StepRest:
    """The rest of a decoding step beyond its target pass (by the SPS profile) and its drafter
    call, as measured from one plan start to the next, modelled as ``fixed_s`` + ``per_token_s``
    x B, B the tokens the step verified (its rows' verified drafts + 1 each): the least-squares
    line over the cycles seen, each of the first ``window`` weighing equally, later ones slowly
    forgetting. The slope is never negative (a line fitted to noise could say that verifying
    more saves time); with one distinct B so far it is 0.

    All in seconds; ``samples``: cycles observed."""

    samples: int = 0
    mean_tokens: float = 0.0
    mean_s: float = 0.0
    mean_tokens_sq: float = 0.0
    mean_tokens_s: float = 0.0
    window: int = 50

    def observe(self, tokens: float, rest_s: float) -> None:
        """One cycle: ``tokens`` verified, ``rest_s`` seconds beyond the pass and the drafter."""
        self.samples += 1
        w = max(1.0 / self.window, 1.0 / self.samples)
        self.mean_tokens += w * (tokens - self.mean_tokens)
        self.mean_s += w * (rest_s - self.mean_s)
        self.mean_tokens_sq += w * (tokens * tokens - self.mean_tokens_sq)
        self.mean_tokens_s += w * (tokens * rest_s - self.mean_tokens_s)

    @property
    def per_token_s(self) -> float:
        """Seconds the rest grows by per verified token (>= 0)."""
        var = self.mean_tokens_sq - self.mean_tokens ** 2
        if var <= 1e-9:
            return 0.0
        return max(0.0, (self.mean_tokens_s - self.mean_tokens * self.mean_s) / var)

    @property
    def fixed_s(self) -> float:
        """Seconds of the rest whatever the step verifies (>= 0)."""
        return max(0.0, self.mean_s - self.per_token_s * self.mean_tokens)

    def seconds(self, tokens: float) -> float:
        """The predicted rest of a step verifying ``tokens`` tokens."""
        return self.fixed_s + self.per_token_s * tokens


@dataclass(frozen=True, slots=True)
class FloorScore:
    """A candidate plan's prediction: ``worst`` = min over floored requests of min(1, speed /
    floor) (1.0 without floors), ``goodput`` = committed tokens/s of the step, ``speeds`` = per
    request tokens/s."""

    worst: float
    goodput: float
    speeds: tuple[float, ...]


def score_plan(rows: Sequence[FloorRow], lengths: Sequence[int], sps: SPSTable,
               draft_cost: DraftCostTable | None, sampled: bool, fixed_s: float = 0.0,
               per_token_s: float = 0.0) -> FloorScore:
    """Predicted per-request speeds of the step that drafts for the rows with ``lengths[r] > 0``
    and verifies that many of their draft tokens (each drafting one more, at most its cap).

    Args:
        rows: the running requests.
        lengths: per row the predicted verification length l_r (0: not drafted for).
        sps: the SPS(B) profile (steps/s); B = the rows' fixed tokens + sum l_r.
        draft_cost: the drafter's cost table (None: drafting is free).
        sampled: whether any request samples (the cost column).
        fixed_s: seconds of a step beyond the target pass and the drafter call (>= 0; the
            engine's measured rest, prompt chunks riding included on average).
        per_token_s: seconds that rest grows by per token of B (>= 0; :class:`StepRest`).
    Returns:
        a :class:`FloorScore`.
    """
    drafted = [i for i, row in enumerate(rows) if lengths[i] > 0 and row.alpha is not None]
    batch = sum(row.fixed_tokens for row in rows) + sum(lengths[i] for i in drafted)
    seconds = sps.pass_seconds(batch) + fixed_s + per_token_s * batch
    if drafted and draft_cost is not None:
        longest = max(min(rows[i].cap, lengths[i] + 1) for i in drafted)
        seconds += (draft_cost.seconds(len(drafted), longest, sampled)
                    + sum(rows[i].backlog_s for i in drafted))
    gains = [row.fixed_gain + (expected_accepted(row.alpha, lengths[i]) if i in drafted else 0.0)
             for i, row in enumerate(rows)]
    speeds = tuple(g / seconds for g in gains)
    ratios = [min(1.0, s / row.floor) for s, row in zip(speeds, rows) if row.floor is not None]
    return FloorScore(min(ratios, default=1.0), sum(gains) / seconds, speeds)


def plan_for_floors(rows: Sequence[FloorRow], sps: SPSTable, draft_cost: DraftCostTable | None,
                    sampled: bool, limit: int, fixed_s: float = 0.0, per_token_s: float = 0.0
                    ) -> list[int] | None:
    """The drafting that keeps the floors, or None when the goodput plan already does.

    Candidates: the goodput plan (``row.length``); drafting for nobody; and for every common
    length l in [1, max cap], l_r = max(length_r, min(l, cap_r)) for (a) the requests predicted
    below their floor under the goodput plan, (b) every request with a floor that the drafter can
    draft for, the other rows either as the goodput plan has them or not drafted for. Chosen: the
    largest (worst, goodput) of :func:`score_plan` among those within ``limit`` tokens (worst
    rounded to 1e-6, so that plans keeping every floor compare by throughput alone).

    Args:
        rows: the running requests (:class:`FloorRow`).
        sps, draft_cost, sampled, fixed_s, per_token_s: as :func:`score_plan`.
        limit: the most tokens a pass may verify.
    Returns:
        per row the verification length to plan (0: no draft), or None: no request is predicted
        below its floor, or no candidate beats the goodput plan.
    Source: this project's SLA extension of DSpark Algorithm 1 (issue 43; the paper's production
    frontier, section 5).
    """
    base = [row.length if row.alpha is not None else 0 for row in rows]
    score = lambda ls: score_plan(rows, ls, sps, draft_cost, sampled, fixed_s,  # noqa: E731
                                  per_token_s)
    first = score(base)
    if first.worst >= 1.0:
        return None
    below = [i for i, row in enumerate(rows)
             if row.floor is not None and first.speeds[i] < row.floor]
    floored = [i for i, row in enumerate(rows) if row.floor is not None]
    fixed = sum(row.fixed_tokens for row in rows)
    best_key, best = (round(first.worst, 6), first.goodput), None

    def consider(lengths: list[int]) -> None:
        nonlocal best_key, best
        s = score(lengths)
        key = (round(s.worst, 6), s.goodput)
        if key > best_key:
            best_key, best = key, lengths

    # drafting for nobody: every step as short as it gets. Drafting for some requests makes the
    # others' steps longer, and the slowest request is what a floor is about (measured: at 4-16
    # streams drafting left the slowest request below plain decoding's at the same mean)
    nobody = [0] * len(rows)
    consider(nobody)
    # dropping the others' drafts differs from keeping them only when the goodput plan drafts
    others_choices = (base, nobody) if any(base) else (base,)
    for group in (below, floored):
        lift = [i for i in group if rows[i].alpha is not None and rows[i].cap > 0]
        for l in range(1, max((rows[i].cap for i in lift), default=0) + 1):
            # the goodput plan's other rows kept, or dropped (their drafts lengthen the step
            # of the request being lifted)
            for others in others_choices:
                lengths = list(others)
                for i in lift:
                    lengths[i] = max(base[i], min(l, rows[i].cap))
                if fixed + sum(lengths) <= limit:
                    consider(lengths)
    return best


def apply_floors(plan: DraftPlan, options: Sequence[RequestOptions],
                 floors: Sequence[float | None], sps: SPSTable,
                 draft_cost: DraftCostTable | None, sampled: bool, limit: int,
                 fixed_s: float = 0.0, per_token_s: float = 0.0) -> bool:
    """Re-choose a goodput plan's drafting for the per-user speed floors
    (:func:`plan_for_floors`), in place: a drafter row whose predicted length the floor plan
    lengthens drafts one token beyond it (at most its cap; at least what a fill had it draft)
    and is no probe any more; a row it drops drafts nothing; the other rows stay as the goodput
    plan has them (lookup rows, fill drafts, due probes; when the floor plan drafts for nobody,
    the due probes wait too, so that the step calls no drafter).
    ``plan.predicted_tps`` becomes the floor plan's predicted goodput (on the measured SPS(B),
    without fills).

    Args:
        plan: :func:`serve.engine.draft_planner.plan_drafts`'s plan for ``options``.
        options: the running requests' :class:`RequestOptions`, in plan order.
        floors: per request its floor in tokens/s, or None.
        sps, draft_cost, sampled, limit, fixed_s, per_token_s: as :func:`plan_for_floors`.
    Returns:
        whether the plan changed.
    Raises:
        ValueError: ``floors`` or the plan not of the requests' length.
    """
    n = len(options)
    if len(floors) != n or len(plan.sources) != n:
        raise ValueError(f"{n} requests but {len(floors)} floors and {len(plan.sources)} plan rows")
    if all(f is None for f in floors):
        return False
    rows = []
    for i, o in enumerate(options):
        model = o.model_alpha is not None and o.cap > 0 and plan.sources[i] != "lookup"
        probe = plan.probed[i]
        look = plan.predicted_lengths[i] if plan.sources[i] == "lookup" else 0
        look_alpha = plan.lookup_confidences[i][0] if look else 0.0
        rows.append(FloorRow(
            floors[i], o.model_alpha if model else None, o.cap if model else 0,
            0 if probe or not model else plan.predicted_lengths[i], 1 + look,
            1.0 + (expected_accepted(look_alpha, look) if look else 0.0),
            draft_cost.backlog_seconds(o.pending) if model and draft_cost else 0.0))
    lifted = plan_for_floors(rows, sps, draft_cost, sampled, limit, fixed_s, per_token_s)
    if lifted is None:
        return False
    base = [row.length for row in rows]
    if not any(lifted) and any(plan.probed):
        # drafting for nobody: a due probe would still call the drafter, which the plan was
        # scored without; the probes stay due for a step whose drafting pays
        for i in range(n):
            if plan.probed[i]:
                plan.sources[i], plan.num_draft_tokens[i], plan.probed[i] = None, 0, False
        plan.probe_cost_s = 0.0
    for i, row in enumerate(rows):
        if row.alpha is None or lifted[i] == base[i]:
            continue  # as the goodput plan has it (its fill drafts, a due probe)
        drafts = lifted[i] > 0
        plan.sources[i] = "model" if drafts else None
        # one beyond its new length, never fewer than a fill asked for
        plan.num_draft_tokens[i] = (max(plan.num_draft_tokens[i], min(row.cap, lifted[i] + 1))
                                    if drafts else 0)
        plan.predicted_lengths[i] = lifted[i]
        plan.probed[i] = False
    plan.predicted_tps = score_plan(rows, lifted, sps, draft_cost, sampled, fixed_s,
                                    per_token_s).goodput
    return True
