"""The Serve replica's Prometheus metrics (``ray.serve.metrics``; names get Ray's ``ray_`` prefix
and counters a ``_total`` suffix): engine counters from
:class:`serve.engine.metrics.SpecDecodeStats` snapshots, and per-request latency (TTFT, TPOT, end to
end) and token histograms. Ray is imported only when a replica builds them.
"""

from __future__ import annotations

import time

from .async_engine import EngineSnapshot, copy_stats, rounds_by_verified_length, stats_delta
from .engine.metrics import SpecDecodeStats
from .engine.requests import RequestOutput


TTFT_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120]
LATENCY_BUCKETS_S = [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640]
TPOT_BUCKETS_S = [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5]
TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class ServeMetrics:
    """Replica metrics through ``ray.serve.metrics`` (deployment/replica/application tags added by
    Serve; Prometheus names get Ray's ``ray_`` prefix). Engine counters are exported as
    differences of :class:`EngineSnapshot` taken periodically on the replica's event loop, so the
    engine thread never touches a metric. ``infra/grafana/dspark_serve.json`` charts them.

    Speculative decoding under vLLM's names (``vllm:`` becomes ``vllm_``: Ray metric names cannot
    hold a colon): ``vllm_spec_decode_num_drafts`` (rounds that proposed drafts),
    ``vllm_spec_decode_num_draft_tokens`` (draft tokens sent to verification: vLLM verifies every
    draft token, DSpark's scheduler may verify fewer than it drafted),
    ``vllm_spec_decode_num_accepted_tokens`` and ``vllm_spec_decode_num_accepted_tokens_per_pos``
    (tag ``position``, 0-based as vLLM's); acceptance rate = accepted / draft tokens.
    DSpark's own: ``dspark_drafted_tokens`` (all proposed), ``dspark_committed_tokens`` (bonus
    included), ``dspark_rounds``, ``dspark_engine_steps``, ``dspark_failed_requests``,
    ``dspark_verified_tokens_per_position`` (tag ``position``, 1-based; accepted / verified per
    position = accept_rate@k over the rounds verifying k, SPEC 5), histogram
    ``dspark_verification_budget_tokens`` (l_r per request per step, SPEC 6; buckets at k + 0.5).
    Request level (vLLM's names): ``vllm_e2e_request_latency_seconds``,
    ``vllm_time_to_first_token_seconds``, ``vllm_time_per_output_token_seconds`` (after the first
    token), ``vllm_request_prompt_tokens``, ``vllm_request_generation_tokens``,
    ``vllm_request_success`` (Prometheus: ``ray_vllm_request_success_total``, tag
    ``finished_reason``: stop, length, abort, error), and the exact token counters
    ``vllm_prompt_tokens`` / ``vllm_generation_tokens`` (Prometheus:
    ``ray_vllm_prompt_tokens_total`` / ``ray_vllm_generation_tokens_total``): each finished
    request adds its ``usage`` prompt and completion tokens, so their sums over the served
    requests are these counters.
    Gauges: ``dspark_num_waiting_requests``, ``dspark_num_running_requests``,
    ``dspark_engine_alive`` (1/0). Every tag takes a bounded set of values (no free-form user
    label).

    Ray 2.60's OpenTelemetry recorder reports a histogram's ``_sum`` from bucket midpoints, so
    read the bucket counts (exact), not ``_sum / _count``; token totals come from the counters.
    """

    COUNTERS = {"drafted_rounds": "vllm_spec_decode_num_drafts",
                "verified_tokens": "vllm_spec_decode_num_draft_tokens",
                "accepted_tokens": "vllm_spec_decode_num_accepted_tokens",
                "drafted_tokens": "dspark_drafted_tokens",
                "committed_tokens": "dspark_committed_tokens",
                "rounds": "dspark_rounds", "steps": "dspark_engine_steps",
                "failed_requests": "dspark_failed_requests"}
    FINISH_REASONS = ("stop", "length", "abort", "error")

    def __init__(self, num_speculative_tokens: int):
        from ray.serve import metrics as m  # Ray only where the replica runs

        self.counters = {field: m.Counter(name, description=f"SpecDecodeStats.{field} (raw).")
                         for field, name in self.COUNTERS.items()}
        self.accepted_pos = m.Counter("vllm_spec_decode_num_accepted_tokens_per_pos",
                                      tag_keys=("position",),
                                      description="Accepted draft tokens at position k (0-based).")
        self.verified_pos = m.Counter("dspark_verified_tokens_per_position", tag_keys=("position",),
                                      description="Rounds that verified draft position k (1-based).")
        self.budget = m.Histogram("dspark_verification_budget_tokens",
                                  description="Draft tokens verified per request per step.",
                                  boundaries=[k + 0.5 for k in
                                              range(max(num_speculative_tokens, 1) + 1)])
        self.e2e = m.Histogram("vllm_e2e_request_latency_seconds", boundaries=LATENCY_BUCKETS_S,
                               description="Request arrival to its last token (s).")
        self.ttft = m.Histogram("vllm_time_to_first_token_seconds", boundaries=TTFT_BUCKETS_S,
                                description="Request arrival to first token (s).")
        self.tpot = m.Histogram("vllm_time_per_output_token_seconds", boundaries=TPOT_BUCKETS_S,
                                description="Seconds per output token after the first.")
        self.prompt_tokens = m.Histogram("vllm_request_prompt_tokens", boundaries=TOKEN_BUCKETS,
                                         description="Prompt tokens per request.")
        self.generation_tokens = m.Histogram("vllm_request_generation_tokens",
                                             boundaries=TOKEN_BUCKETS,
                                             description="Generated tokens per request.")
        self.prompt_tokens_total = m.Counter(
            "vllm_prompt_tokens", description="Prompt tokens of finished requests (usage).")
        self.generation_tokens_total = m.Counter(
            "vllm_generation_tokens", description="Generated tokens of finished requests (usage).")
        self.finished = m.Counter("vllm_request_success", tag_keys=("finished_reason",),
                                  description="Finished requests by finish reason.")
        self.waiting = m.Gauge("dspark_num_waiting_requests", description="Engine queue length.")
        self.running = m.Gauge("dspark_num_running_requests", description="Requests decoding.")
        self.alive = m.Gauge("dspark_engine_alive", description="1 while the engine is healthy.")
        self._prev = SpecDecodeStats()
        self.exported = SpecDecodeStats()  # totals pushed so far (for /health and tests)

    def update(self, snap: EngineSnapshot) -> None:
        """Push the counter increments since the previous call and set the gauges."""
        delta = stats_delta(self._prev, snap.stats)
        self._prev = snap.stats
        for field, counter in self.counters.items():
            value = getattr(delta, field)
            if value > 0:
                counter.inc(value)
        for k, (v, a) in enumerate(zip(delta.verified_per_position, delta.accepted_per_position)):
            if v > 0:
                self.verified_pos.inc(v, tags={"position": str(k + 1)})
            if a > 0:
                self.accepted_pos.inc(a, tags={"position": str(k)})
        for length, count in rounds_by_verified_length(delta).items():
            for _ in range(count):
                self.budget.observe(length)
        self.waiting.set(snap.num_waiting)
        self.running.set(snap.num_running)
        self.alive.set(0 if snap.dead else 1)
        self.exported = copy_stats(snap.stats)


class RequestTimer:
    """Request-level metrics of one request, measured on the event loop."""

    def __init__(self, metrics: ServeMetrics, num_prompt_tokens: int, arrival_s: float):
        self.metrics, self.arrival_s = metrics, arrival_s
        self.num_prompt_tokens = num_prompt_tokens
        self.first_s: float | None = None
        self.first_tokens = 0
        self.last_s = arrival_s
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.new_token_ids and self.first_s is None:
            self.first_s, self.first_tokens = now, out.num_generated_tokens
            self.metrics.ttft.observe(now - self.arrival_s)
        self.last_s = now

    def finish(self, last: RequestOutput | None, reason: str | None = None) -> None:
        """Record the finished request once; ``reason`` overrides (a client that went away is an
        abort, a failed request an error)."""
        if self.done:
            return
        self.done = True
        reason = reason or (last.finish_reason if last is not None and last.finished else "abort")
        if reason not in ServeMetrics.FINISH_REASONS:
            reason = "error"
        m = self.metrics
        m.finished.inc(1, tags={"finished_reason": reason})
        generated = last.num_generated_tokens if last is not None else 0
        m.prompt_tokens.observe(self.num_prompt_tokens)
        m.generation_tokens.observe(generated)
        m.prompt_tokens_total.inc(self.num_prompt_tokens)
        if generated:  # Ray's counters refuse a zero increment
            m.generation_tokens_total.inc(generated)
        m.e2e.observe(self.last_s - self.arrival_s)
        if last is None or self.first_s is None:
            return
        tokens, seconds = last.num_generated_tokens - self.first_tokens, self.last_s - self.first_s
        if tokens > 0 and seconds > 0:
            m.tpot.observe(seconds / tokens)
