"""The typed plan of one engine step, and the planner that makes it (SPEC 5 and 6).

A step plans in two halves around the drafter call. Before it, per running request: the cap (the
most draft tokens it may verify), and the draft source and ``num_draft_tokens`` from the goodput
planner (``serve/engine/draft_planner.py``, from the request's past rounds only). After it: how
many drafted tokens each verifies, from this step's calibrated confidences, by the scheduler the
config names (``serve/engine/scheduler_registry.py``: every policy question goes to its entry).
After verification the planner learns from each round. Losslessness: no decision about a draft
token x_k reads x_k or anything computed from it (``serve/engine/scheduler.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import EngineConfig
from .cost_check import CostCheck
from .draft_planner import AcceptanceEstimate, DraftCostTable, RequestOptions, Source, plan_drafts
from .floor_plan import StepRest, apply_floors
from .request_state import RequestState
from .plan_extensions import fill_pass, hold_speed_floors
from .scheduler_registry import scheduler_entry, scheduler_for
from .sps import SPSTable


@dataclass
class PlanRow:
    """One running request's part of the step; K = ``len(tokens)`` draft tokens proposed, V the
    target's vocabulary."""

    request: RequestState
    # the most draft tokens it may verify: num_speculative_tokens, its budget, the drafter's context
    cap: int
    source: Source | None = None  # "model" (the drafter), "lookup" (prompt lookup), None: none
    num_draft_tokens: int = 0  # draft tokens to propose, <= cap
    probed: bool = False  # the drafter drafts for it as a probe (back-off), not because it pays
    tokens: list[int] = field(default_factory=list)  # [K] the draft x_1..x_K
    probs: torch.Tensor | None = None  # fp32 [K, V] the drafter's distributions; None: greedy
    confidence_logits: list[float] | None = None  # [K] raw z_k; None: no confidence head
    # [K] calibrated c_k (a lookup draft: the planner's predicted ones; [] when there are none)
    confidences: list[float] = field(default_factory=list)
    length: int = 0  # l <= K: the draft tokens it verifies (the scheduler's choice)


@dataclass
class StepPlan:
    """The running requests' rows of one step in running order, and when its phases began
    (perf_counter seconds): planning and drafting from ``start_s``, verification from
    ``verify_start_s``."""

    rows: list[PlanRow] = field(default_factory=list)
    start_s: float = 0.0
    verify_start_s: float = 0.0
    # the drafter call's seconds as the draft-cost profile predicts them (0: no prediction)
    predicted_draft_s: float = 0.0

    @classmethod
    def make_empty(cls) -> StepPlan:
        """The plan of a step with nothing to decode."""
        return cls()


class StepPlanner:
    """Plans each step's drafting and verification for the engine, and learns from its rounds.

    Args:
        config: the engine's knobs.
        scheduler: the scheduler's registry name ("none" without a drafter).
        num_speculative_tokens: the cap in effect, draft tokens per round at most (0 without a
            drafter).
        drafter_context: the drafter's context limit in positions (None without a drafter).
        sps, draft_cost: the SPS(B) profile and the drafter's cost, as :class:`SpecEngine`.
        plans: whether the goodput planner runs (else the drafter drafts num_speculative_tokens
            for everyone).
    Raises:
        ValueError: the scheduler needs something missing (e.g. an SPS(B) table).
    """

    def __init__(self, config: EngineConfig, scheduler: str, num_speculative_tokens: int,
                 drafter_context: int | None, sps: SPSTable | None,
                 draft_cost: DraftCostTable | None, plans: bool):
        self.config, self.drafter_context = config, drafter_context
        self.num_speculative_tokens = num_speculative_tokens
        self.sps, self.draft_cost, self.plans = sps, draft_cost, plans
        self.policy = scheduler_entry(scheduler)
        # passes filled to the fastest length at or above the scheduled one (jagged CPU
        # profiles): the goodput decisions then read the measured SPS(B)'s upper envelope, up to
        # the pass the step's proposed drafts allow (never a speed no proposal could reach)
        self.fills = bool(config.fill_passes and sps is not None and self.policy.needs_sps)
        self.scheduler_name = scheduler
        self.schedule_fn = self._scheduler(sps)
        self.envelopes: dict[int, tuple[SPSTable, Callable]] = {}  # reach -> (envelope, scheduler)
        self.probe_credit = 0.0  # seconds of drafter time probes may still spend (probe_budget)
        # the drafter's engine-wide realized acceptance, greedy and sampled: a new request's
        # prior, so that with a drafter that accepts little here every newcomer does not start at
        # 1/2 and pay for drafts until its own rounds say no (slowly forgetting: ~50 rounds).
        # Prompt lookup keeps the neutral prior: its drafts cost nothing to propose.
        self.drafter_prior = [AcceptanceEstimate(decay=0.98), AcceptanceEstimate(decay=0.98)]
        self.stale: deque[list[list[float]]] = deque(maxlen=2)  # confidences of past steps
        # the profiles against the engine's own measured steps (a profile made under load)
        self.draft_checker, self.sps_checker = CostCheck("draft cost"), CostCheck("SPS(B)")
        # on for profiles measured on this machine (the builder's); tables handed in directly
        # (a test's, a benchmark's) are taken as given
        self.checks_costs = False
        self.steps_without_drafter = 0  # consecutive planned steps without a drafter call
        # seconds of a decoding cycle (plan start to the next plan start) beyond the drafter call
        # and the decoding rows' target pass by the profile: sampling, verification, commit,
        # prompt chunks riding, the serving threads' turns between steps (and what the profile
        # misses), slowly forgetting (~50 steps: a prompt chunk's step is a spike); what the
        # per-user speed floors' predictions add to the profiles. Measured at 8 streams on a
        # 2-core CPU: the pass and the drafter alone predicted 18.4 tokens/s a request, clients
        # read 12.1-12.8 (prompt chunks riding in the passes)
        self.rest = StepRest()
        # the last decoding step's (plan start, drafter seconds, its decoding rows' pass by the
        # SPS profile, the tokens it verified); None after a step without decoding or one that
        # failed before its commit
        self.last_cycle: tuple[float, float, float, int] | None = None

    def _scheduler(self, sps: SPSTable | None):
        return scheduler_for(self.scheduler_name, sps=sps,
                             num_speculative_tokens=max(self.num_speculative_tokens, 1),
                             threshold=self.config.threshold,
                             max_batch_tokens=self.config.max_batch_tokens)

    def envelope(self, reach: int) -> tuple[SPSTable | None, Callable]:
        """The SPS table a step's verification schedules on, and its scheduler: with ``fills``
        the measured table's upper envelope up to ``reach`` tokens (``SPSTable.padded``), else
        the measured table.

        Args:
            reach: the longest pass the step's proposals allow, R + sum_r K_r tokens (fixed
                before drafting: reading it keeps the schedule lossless).
        """
        if not self.fills:
            return self.sps, self.schedule_fn
        limit = self.sps.max_tokens
        if self.config.max_batch_tokens:
            limit = min(limit, self.config.max_batch_tokens)
        reach = max(1, min(limit, reach))
        if reach not in self.envelopes:
            table = self.sps.padded(reach)
            self.envelopes[reach] = (table, self._scheduler(table))
        return self.envelopes[reach]

    def start(self, r: RequestState) -> None:
        """A request the drafter starts drafting for: its probe back-off and its drafter
        acceptance prior (the engine-wide realized one)."""
        r.backoff = self.config.probe_interval
        r.model_acc = AcceptanceEstimate(prior=self.drafter_prior[r.req.params.temperature > 0]
                                         .alpha)

    def caps(self, reqs: list[RequestState]) -> list[int]:
        """The most draft tokens each request may verify: num_speculative_tokens, one less than its
        remaining budget (a fully accepted block adds a bonus token), and the drafter's context
        limit."""
        if not self.policy.speculates:
            return [0] * len(reqs)
        out = []
        for r in reqs:
            room = r.req.params.max_tokens - len(r.output) - 1
            l = max(0, min(self.num_speculative_tokens, room))
            # beyond its context: target-only steps
            out.append(0 if r.pos + l >= self.drafter_context else l)
        return out

    def start_cycle(self, plan_start_s: float) -> None:
        """A decoding step plans at ``plan_start_s`` (perf_counter seconds): the cycle from the
        last one's plan start, if that step committed, is read (:meth:`observe_rest`): what a
        running request waits per step, prompt chunks riding and the serving threads' turns
        between steps included (a client reads its speed so)."""
        if self.last_cycle is not None:
            last_start, draft_s, pass_s, tokens = self.last_cycle
            self.observe_rest(plan_start_s - last_start, draft_s, pass_s, tokens)
        self.last_cycle = None  # set again only by a step that reaches its commit

    def end_cycle(self, plan: StepPlan, draft_s: float, verify_s: float) -> None:
        """The step of ``plan`` committed after ``draft_s`` seconds of drafting and a target
        pass of ``verify_s`` (measured; what the profile predicts for its decoding rows is what
        the next cycle is read against, so prompt chunks riding fall in the rest)."""
        tokens = sum(row.length + 1 for row in plan.rows)
        pass_s = (self.sps.pass_seconds(tokens) if self.sps is not None and plan.rows
                  else verify_s)
        self.last_cycle = (plan.start_s, draft_s, pass_s, tokens)

    def break_cycle(self) -> None:
        """A step without decoding (an idle gap, a prefill-only step): no cycle to read."""
        self.last_cycle = None

    def observe_rest(self, cycle_s: float, draft_s: float, pass_s: float, tokens: int = 1
                     ) -> None:
        """A decoding cycle's measured seconds (one plan start to the next), its drafter call's
        (measured), its decoding rows' target pass by the SPS profile and the ``tokens`` it
        verified: one sample of :attr:`rest` (:class:`serve.engine.floor_plan.StepRest`; a rest
        below 0, a pass the profile overrates, counts as 0)."""
        self.rest.observe(tokens, max(0.0, cycle_s - draft_s - pass_s))

    def plan(self, reqs: list[RequestState], start_s: float, riding: int = 0,
             floors: list[float | None] | None = None) -> StepPlan:
        """The step's rows: source, num_draft_tokens and probing from the goodput planner (a lookup
        row gets its draft and predicted confidences now), or num_speculative_tokens (each row's
        cap) from the drafter for every request without it. ``riding``: prompt tokens packed
        into the step's target pass; such a pass is not filled (:meth:`schedule`), so the
        planner drafts no fill for it either. ``floors``: per request its per-user speed floor
        (tokens/s) or None; a request predicted below it is drafted for where that raises it
        (:func:`serve.engine.floor_plan.apply_floors`; prompt chunks count in the measured rest
        of a step, :attr:`rest`, not in this step's prediction)."""
        caps = self.caps(reqs)
        if not self.plans:
            return StepPlan([PlanRow(r, c, "model" if c > 0 else None, c)
                             for r, c in zip(reqs, caps)], start_s)
        options, looks = [], []
        for r, cap in zip(reqs, caps):
            look = r.lookup.propose(cap) if r.lookup is not None and cap > 0 else []
            looks.append(look)
            options.append(RequestOptions(cap, r.model_acc.alpha if cap > 0 else None, len(look),
                                          r.lookup_acc.alpha, probe_due=r.skipped >= r.backoff,
                                          pending=len(r.pending.tokens)))
        sampled = any(r.req.params.temperature > 0 for r in reqs)
        plan = plan_drafts(options, self.sps, self.draft_cost, sampled,
                           self.config.max_batch_tokens, probe_allowance_s=self.probe_credit,
                           min_gain=self.config.min_draft_gain,
                           probe_alpha=self.config.probe_alpha,
                           fills=self.fills and not riding)
        if floors is not None:
            limit = self.sps.max_tokens
            if self.config.max_batch_tokens:
                limit = min(limit, self.config.max_batch_tokens)
            apply_floors(plan, options, floors, self.sps, self.draft_cost, sampled, limit,
                         self.rest.fixed_s, self.rest.per_token_s)
        # the budget grows by its share of a target-only step of this batch (a prediction, so
        # the plan stays a function of the past only), up to one full-block call for everyone
        ceiling = (self.draft_cost.seconds(len(reqs), self.draft_cost.block_size, sampled)
                   if self.draft_cost is not None else 0.0)
        self.probe_credit = min(ceiling, self.probe_credit - plan.probe_cost_s
                                + self.config.probe_budget / self.sps.sps(len(reqs)))
        drafted = [i for i, source in enumerate(plan.sources) if source == "model"]
        self.steps_without_drafter = 0 if drafted else self.steps_without_drafter + 1
        if (not drafted and self.checks_costs and self.draft_cost is not None
                and self.steps_without_drafter > self.config.max_probe_interval):
            # a cost probe: the draft-cost profile itself may be what keeps the drafter off
            # (measured under load), so one request drafts, as a probe, to time it again
            # (serve/engine/cost_check.py); at most once per max_probe_interval steps
            waiting = [i for i, cap in enumerate(caps) if cap > 0 and plan.sources[i] is None]
            if waiting:
                i = max(waiting, key=lambda j: reqs[j].skipped)
                plan.sources[i], plan.num_draft_tokens[i] = "model", caps[i]
                plan.probed[i] = True
                drafted = [i]
                self.steps_without_drafter = 0
        predicted = (self.draft_cost.seconds(len(drafted), max(
            (plan.num_draft_tokens[i] for i in drafted), default=0), sampled)
            + sum(self.draft_cost.backlog_seconds(options[i].pending) for i in drafted)
            if self.draft_cost is not None and drafted else 0.0)
        rows = []
        for i, (r, cap) in enumerate(zip(reqs, caps)):
            source, num_draft_tokens = plan.sources[i], plan.num_draft_tokens[i]
            rows.append(PlanRow(r, cap, source, num_draft_tokens, plan.probed[i],
                                list(looks[i][:num_draft_tokens]) if source == "lookup" else [],
                                confidences=list(plan.lookup_confidences[i])))
        return StepPlan(rows, start_s, predicted_draft_s=predicted)

    def check_costs(self, plan: StepPlan, draft_s: float, verify_tokens: int,
                    verify_s: float) -> list[str]:
        """Compare a step's measured drafter call and target pass with the profiles'
        predictions (``serve/engine/cost_check.py``) and rescale a profile the engine's own
        steps contradict. Only where the goodput planner reads both profiles in seconds.

        Args:
            plan: the step's plan (its predicted drafter seconds).
            draft_s: measured seconds of the step's drafter call (0: none).
            verify_tokens: tokens of the step's target pass (0: not comparable, e.g. prompt
                chunks packed into it).
            verify_s: measured seconds of that pass.
        Returns:
            the names of the profiles rescaled now ("draft_cost", "sps"); usually none, and
            always none unless :attr:`checks_costs` (set by the engine builder).
        """
        if not self.checks_costs or self.draft_cost is None or self.sps is None:
            return []
        corrected = []
        if plan.predicted_draft_s > 0 and draft_s > 0:
            factor = self.draft_checker.observe(plan.predicted_draft_s, draft_s)
            if factor is not None:
                self.draft_cost = self.draft_cost.scaled(factor)
                corrected.append("draft_cost")
        if 0 < verify_tokens <= self.sps.max_tokens:
            factor = self.sps_checker.observe(1.0 / self.sps.sps(verify_tokens), verify_s)
            if factor is not None:
                # schedule_fn keeps the original table: a uniform scale leaves the argmax of
                # tau * SPS(B) unchanged; the planner, speed floors and admission read this one
                self.sps = self.sps.scaled(factor)
                self.envelopes.clear()
                corrected.append("sps")
        return corrected

    def schedule(self, plan: StepPlan, floors: list[float | None], riding: int = 0) -> None:
        """Set each row's verification length l from the configured policy, clipped to its
        drafts; ``floors``: per row its speed floor in tokens/s, or None; ``riding``: prompt
        tokens packed into the same target pass (such a pass is not filled: the profile's
        speeds are of passes of draft rows only).

        Rows without confidences (a drafter without a confidence head, under fixed or none) are
        given placeholder ones: those policies read only the row lengths."""
        drafted = [len(row.tokens) for row in plan.rows]
        rows = [row.confidences if len(row.confidences) == n else [1.0] * n
                for row, n in zip(plan.rows, drafted)]
        stale = None
        if self.policy.reads_stale_confidences:  # capacity from two steps earlier (section 5.2)
            stale = self.stale[0] if len(self.stale) == 2 else None
            if stale is not None and not any(stale):
                # nothing was drafted then (the planner skipped the drafter): like the warm-up,
                # Algorithm 1 on the current confidences (the choice depends on the past only)
                stale = None
        fills = self.fills and not riding
        table, schedule_fn = (self.envelope(len(rows) + sum(drafted)) if fills
                              else (self.sps, self.schedule_fn))
        lengths = [min(l, n) for l, n in zip(schedule_fn(rows, stale), drafted)]
        if (floors and any(f is not None for f in floors) and self.sps is not None
                and self.policy.reads_confidence):
            # requests predicted below their speed floor get verification first (lossless)
            lengths = hold_speed_floors([row[:n] for row, n in zip(rows, drafted)], lengths,
                                        table, floors, self.config.max_batch_tokens,
                                        fixed_s=plan.predicted_draft_s + self.rest.fixed_s,
                                        per_token_s=self.rest.per_token_s)
        if fills:  # a longer pass that runs faster verifies more draft tokens (lossless)
            lengths = fill_pass([row[:n] for row, n in zip(rows, drafted)], lengths, self.sps,
                                self.config.max_batch_tokens)
        for row, l in zip(plan.rows, lengths):
            row.length = l

    def remember(self, plan: StepPlan) -> None:
        """Keep the step's confidences for the schedulers that read stale ones."""
        self.stale.append([row.confidences for row in plan.rows])

    def learn(self, row: PlanRow, accepted: int) -> None:
        """Update the request's acceptance estimates and probe back-off after its round.

        Both sources learn from what verification saw (accepted n of l verified: n successes in
        n + [n < l] trials). A drafter round the scheduler did not verify (l = 0) still informs
        the drafter's alpha through its calibrated confidences (expected successes sum_j a_j over
        expected trials sum_j a_{j-1}). Realized outcomes come first because a confidence head
        calibrated on other data can be optimistic on this request's domain (measured: chat at
        T = 1), and an optimistic alpha keeps paying for drafts that are rejected. Realized
        drafter outcomes also feed the engine-wide prior that requests admitted later start
        from."""
        if not self.plans:
            return
        r, verified = row.request, row.length
        if row.source == "model":
            if verified:
                r.model_acc.update(accepted, accepted + (accepted < verified))
                self.drafter_prior[r.req.params.temperature > 0].update(  # realized only
                    accepted, accepted + (accepted < verified))
            elif row.confidences:
                survival, reach = 1.0, 0.0
                for c in row.confidences:
                    reach += survival
                    survival *= c
                r.model_acc.update(reach - 1.0 + survival, reach)
            r.skipped = 0
            r.backoff = (min(2 * r.backoff, self.config.max_probe_interval) if row.probed
                         else self.config.probe_interval)
        elif row.source == "lookup":
            if verified:
                r.lookup_acc.update(accepted, accepted + (accepted < verified))
        elif row.cap > 0:
            r.skipped += 1
