"""Raw speculative-decoding counters (vLLM's SpecDecodingStats style): rates are derived when read,
each definition written once here. Evaluation, serving and the benchmarks all read these.

Definitions (SPEC 0 and 5): a *round* is one verification of one request; tau = committed tokens per
round (bonus token included); accept_rate@k = share of the rounds that verified at least k drafts
whose first k drafts were all accepted (prefix survival; with a fixed draft length,
P(accepted >= k)); conditional acceptance at k = share of the rounds that verified position k and
accepted positions 1..k-1 that accepted position k too (P(token k accepted | tokens < k
accepted), paper Fig. 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args


@dataclass
class SpecDecodeStats:
    """Counters accumulated by the engine. ``verified_per_position[k]``: rounds that verified a
    draft token at position k+1; ``accepted_per_position[k]``: rounds that accepted it (and so
    every earlier one); ``reached_per_position[k]``: rounds that verified position k+1 with
    positions 1..k all accepted."""

    steps: int = 0
    failed_requests: int = 0  # ended by an error in their own processing (the engine went on)
    rounds: int = 0
    drafted_rounds: int = 0  # rounds that proposed at least one draft token (vLLM's "drafts")
    committed_tokens: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    batch_tokens: int = 0
    verified_per_position: list = field(default_factory=list)
    accepted_per_position: list = field(default_factory=list)
    reached_per_position: list = field(default_factory=list)

    def record_round(self, drafted: int, verified: int, accepted: int, committed: int) -> None:
        self.rounds += 1
        self.drafted_rounds += drafted > 0
        self.drafted_tokens += drafted
        self.verified_tokens += verified
        self.accepted_tokens += accepted
        self.committed_tokens += committed
        grow = verified - len(self.verified_per_position)
        if grow > 0:
            self.verified_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
            self.reached_per_position += [0] * grow
        for k in range(verified):
            self.verified_per_position[k] += 1
            if k <= accepted:
                self.reached_per_position[k] += 1
            if k < accepted:
                self.accepted_per_position[k] += 1

    @property
    def tau(self) -> float:
        """Committed tokens per round (bonus included)."""
        return self.committed_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens."""
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    def accept_rate_at_k(self) -> list[float]:
        """accept_rate@1..K: per k, the share of rounds verifying >= k drafts that accepted the
        first k (prefix survival)."""
        return [a / v if v else 0.0 for a, v in zip(self.accepted_per_position,
                                                    self.verified_per_position)]

    def conditional_acceptance(self) -> list[float]:
        """Per k, P(draft k accepted | drafts < k accepted) over the rounds that verified k."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position,
                                                    self.reached_per_position)]

    def mean_verification_budget(self) -> float:
        """Draft tokens verified per request per round."""
        return self.verified_tokens / self.rounds if self.rounds else 0.0


def request_spec_details(rounds) -> dict:
    """One request's speculation, summed over its rounds: what a client asks for with
    ``return_spec_details`` (the same spirit as SGLang's per-request ``spec_verify_ct`` /
    ``spec_accept_histogram`` meta info), computed with the engine-wide counters' definitions.

    Args:
        rounds: the request's round records in order (``serve.engine.core.RoundRecord``: drafted,
            verified, accepted, committed, source), one per target pass after its first token.
    Returns:
        a JSON-ready dict: ``rounds`` (target passes after the first token), ``drafted_rounds``,
        ``verified_rounds`` (rounds that verified >= 1 draft token), ``draft_tokens_proposed`` /
        ``_verified`` / ``_accepted``, ``accept_length`` (tau: committed tokens per round, bonus
        included; None without a round, e.g. a one-token answer), ``acceptance_rate`` (accepted / verified; None when nothing was verified),
        ``accept_histogram`` (entry n: rounds that accepted exactly n draft tokens, rounds that
        verified none counted at 0, so the entries sum to ``rounds``), ``conditional_acceptance``
        (position k: P(draft k accepted | drafts < k accepted); None where no round reached k) and
        ``sources``: per draft source (``model`` = the drafter, ``lookup`` = prompt lookup) its
        rounds, verified and accepted draft tokens.
    """
    total = SpecDecodeStats()
    sources = {"model": SpecDecodeStats(), "lookup": SpecDecodeStats()}
    histogram: list[int] = []
    for r in rounds:
        total.record_round(r.drafted, r.verified, r.accepted, r.committed)
        if r.source in sources:
            sources[r.source].record_round(r.drafted, r.verified, r.accepted, r.committed)
        histogram += [0] * (r.accepted + 1 - len(histogram))
        histogram[r.accepted] += 1
    return {
        "rounds": total.rounds,
        "drafted_rounds": total.drafted_rounds,
        "verified_rounds": total.verified_per_position[0] if total.verified_per_position else 0,
        "draft_tokens_proposed": total.drafted_tokens,
        "draft_tokens_verified": total.verified_tokens,
        "draft_tokens_accepted": total.accepted_tokens,
        "accept_length": total.tau if total.rounds else None,
        "acceptance_rate": total.acceptance_rate if total.verified_tokens else None,
        "accept_histogram": histogram,
        "conditional_acceptance": [a / n if n else None for a, n in
                                   zip(total.accepted_per_position, total.reached_per_position)],
        "sources": {name: {"rounds": s.rounds, "draft_tokens_verified": s.verified_tokens,
                           "draft_tokens_accepted": s.accepted_tokens}
                    for name, s in sources.items()},
    }


# vLLM's per-request switch values (--per-request-spec-decode-metrics)
SpecDecodeMetricsLevel = Literal["none", "summary", "detailed"]
SPEC_DECODE_METRICS_LEVELS = get_args(SpecDecodeMetricsLevel)


def vllm_spec_decode_metrics(rounds, num_spec_tokens: int, detailed: bool = False) -> dict:
    """One request's ``metrics.speculative_decoding`` in the shape of vLLM's per-request
    acceptance stats (vLLM PR #48915, ``--per-request-spec-decode-metrics summary|detailed``),
    so AIPerf, llama-swap and other clients that read vLLM's read this engine's too.

    A *step* is a round that proposed draft tokens (what the ``vllm_spec_decode_num_drafts``
    counter counts); rounds of plain decoding are not steps. A step's draft tokens are those sent
    to verification: vLLM verifies every draft token it keeps and counts those, while DSpark's
    scheduler may verify fewer than it drafted (the unverified ones are like vLLM's drafts dropped
    by structured-output constraints). Summed over requests, ``num_spec_steps``,
    ``num_draft_tokens`` and ``num_accepted_draft_tokens`` equal the increments of the
    ``vllm_spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` counters.

    Args:
        rounds: the request's round records in order (``RoundRecord``: drafted, verified,
            accepted).
        num_spec_tokens: the engine's ``num_speculative_tokens`` k (the longest draft).
        detailed: add ``per_step_accepted`` and ``per_step_drafted`` (one entry per step).
    Returns:
        ``{"mean_acceptance_length": 1 + accepted / steps (1.0 without a step),
        "draft_acceptance_rate": accepted / draft tokens (0.0 without one),
        "acceptance_histogram": [k + 1 ints], entry j: steps that accepted exactly j drafts,
        "num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens"}``
        (+ the two lists when ``detailed``).
    """
    steps = [r for r in rounds if r.drafted > 0]
    accepted = [r.accepted for r in steps]
    drafted = [r.verified for r in steps]
    histogram = [0] * (max([num_spec_tokens] + accepted) + 1)
    for a in accepted:
        histogram[a] += 1
    out = {"mean_acceptance_length": 1.0 + sum(accepted) / len(steps) if steps else 1.0,
           "draft_acceptance_rate": sum(accepted) / sum(drafted) if sum(drafted) else 0.0,
           "acceptance_histogram": histogram,
           "num_spec_steps": len(steps),
           "num_accepted_draft_tokens": sum(accepted),
           "num_draft_tokens": sum(drafted),
           "num_spec_tokens": num_spec_tokens}
    if detailed:
        out["per_step_accepted"], out["per_step_drafted"] = accepted, drafted
    return out
