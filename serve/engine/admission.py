"""Admission: the model length requests are admitted against (what a slot of the engine's KV pool
holds), the checks a request must pass to be queued (each failure a
:class:`serve.engine.errors.RequestError` with its HTTP status), and the speed-floor gate that
decides when the next waiting request may start, from the engine's measured decoding pace (SPEC 5;
issue 24).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .config import EngineConfig
from .errors import RequestError
from .metrics import SPEC_DECODE_METRICS_LEVELS
from .requests import EngineRequest
from .sps import SPSTable
from .target_runner import TargetRunner

logger = logging.getLogger(__name__)

# Admission aims this far above a speed floor: the floor is what the slowest request must get, and
# requests spread around the engine's average pace (measured with a 12 tokens/s floor held on
# average at 8-32 streams: slowest requests 0.73-0.88x the mean), and a client behind HTTP reads
# a few % less than the engine (benchmarks/results/http_tax/2026-12-01_unrecorded_dspark.md: 0.93-0.98x).
FLOOR_MARGIN = 0.15
# A running request's own decode speed counts once it has emitted this many tokens.
MIN_OBSERVED_TOKENS = 8
# Under a speed floor, a step still carries this many prompt tokens, so prompts always advance.
MIN_PREFILL_TOKENS = 32


def observed_speed(output_tokens: int, first_token_s: float | None, now: float) -> float | None:
    """A running request's decode speed so far (tokens/s after its first token), or None before
    ``MIN_OBSERVED_TOKENS`` tokens (too few steps to say)."""
    if first_token_s is None or output_tokens < MIN_OBSERVED_TOKENS:
        return None
    return (output_tokens - 1) / max(now - first_token_s, 1e-9)


def size_kv_pool(target: TargetRunner, config: EngineConfig, num_speculative_tokens: int) -> int:
    """Allocate the engine's whole KV pool now (``serve/engine/kv_pool.py``: never grown under load)
    and return the model length in tokens: what a slot holds, less the draft block of
    ``num_speculative_tokens`` + 1 positions a request's last verification writes past its end,
    at most ``engine.max_model_len`` (default: the target's ``max_position_embeddings``).

    Raises:
        ValueError: ``engine.kv_cache_memory_gib`` holds fewer than 16 tokens per slot.
    """
    wanted_len = config.max_model_len or target.model.config.max_position_embeddings
    block_tokens = num_speculative_tokens + 1  # the draft block written past a request's end
    # a sliding layer's slot holds its window and the longest pass of one request beside it
    pool = target.preallocate(config.max_num_requests, wanted_len + block_tokens,
                              int(config.kv_cache_memory_gib * 2**30),
                              pass_tokens=max(config.max_prefill_tokens, block_tokens))
    max_model_len = min(wanted_len, pool["capacity"] - block_tokens)
    if max_model_len < 16:
        raise ValueError(
            f"engine.kv_cache_memory_gib {config.kv_cache_memory_gib} holds "
            f"{pool['capacity']} positions per slot for {pool['slots']} slots "
            f"(engine.max_num_requests): a model length of {max_model_len} tokens; raise "
            "the budget or lower max_num_requests")
    if max_model_len < wanted_len:
        logger.warning("engine.kv_cache_memory_gib %.2f holds %d slots of %d positions: the "
                       "model length is %d tokens, not %d (raise the budget or lower "
                       "max_num_requests)", config.kv_cache_memory_gib, pool["slots"],
                       pool["capacity"], max_model_len, wanted_len)
    return max_model_len


def check_request(request: EngineRequest, max_model_len: int, vocab_size: int,
                  has_tokenizer: bool) -> None:
    """What a request must satisfy on its own (its ``params`` already normalized).

    Args:
        max_model_len: the most positions a request may use (prompt + max_tokens), in tokens.
        vocab_size: the target's V; stop token ids must be below it.
        has_tokenizer: whether the engine can detokenize (stop strings need it).
    Raises:
        RequestError: empty prompt (400), prompt + max_tokens beyond the model length (413), a
            stop token id outside the vocabulary (400), stop strings without a tokenizer (400), a
            ``spec_decode_metrics`` level other than none / summary / detailed (400).
    """
    p = request.params
    floor = request.min_tokens_per_s
    if floor is not None and not (isinstance(floor, (int, float)) and math.isfinite(floor)
                                  and floor > 0):
        raise RequestError(f"min_tokens_per_s must be a finite number of tokens/s above 0, got "
                           f"{floor!r}", field="min_tokens_per_s")
    if request.spec_decode_metrics not in SPEC_DECODE_METRICS_LEVELS:
        raise RequestError(f"spec_decode_metrics must be one of {SPEC_DECODE_METRICS_LEVELS}, got "
                           f"{request.spec_decode_metrics!r}", field="spec_decode_metrics")
    if not request.prompt_ids:
        raise RequestError("the prompt is empty", field="prompt")
    if len(request.prompt_ids) + p.max_tokens > max_model_len:
        raise RequestError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                           f"({p.max_tokens}) exceeds the model length {max_model_len} "
                           "(engine.max_model_len, or what engine.kv_cache_memory_gib holds)",
                           status=413, field="max_tokens")
    if any(t >= vocab_size for t in p.stop_token_ids):
        raise RequestError(f"stop_token_ids must be below the vocabulary size {vocab_size}",
                           field="stop_token_ids")
    if p.stop and not has_tokenizer:
        raise RequestError("stop strings need an engine with a tokenizer", field="stop")


@dataclass
class Pace:
    """Slowly forgetting averages of the steps running requests decode in: seconds per step,
    tokens committed per running request per step, the step's target-pass tokens split into the
    decoding requests' (verified tokens, B's share that grows with each request) and the prompt
    chunks riding along, and the requests decoding in it."""

    step_s: float | None = None
    tokens_per_step: float = 1.0
    decode_tokens: float = 1.0
    chunk_tokens: float = 0.0
    requests: float = 1.0
    decay: float = 0.9

    @property
    def batch_tokens(self) -> float:
        """The measured steps' B: decoding requests' tokens and prompt chunks."""
        return self.decode_tokens + self.chunk_tokens

    def observe(self, step_s: float, tokens_per_step: float, decode_tokens: int,
                chunk_tokens: int, requests: int) -> None:
        now = (step_s, tokens_per_step, float(decode_tokens), float(chunk_tokens), float(requests))
        if self.step_s is None:
            (self.step_s, self.tokens_per_step, self.decode_tokens, self.chunk_tokens,
             self.requests) = now
            return
        d = self.decay
        self.step_s = d * self.step_s + (1 - d) * now[0]
        self.tokens_per_step = d * self.tokens_per_step + (1 - d) * now[1]
        self.decode_tokens = d * self.decode_tokens + (1 - d) * now[2]
        self.chunk_tokens = d * self.chunk_tokens + (1 - d) * now[3]
        self.requests = d * self.requests + (1 - d) * now[4]

    def predict_step_s(self, requests: float, chunk_tokens: float, sps: SPSTable | None) -> float:
        """Seconds of a step decoding ``requests`` requests (each verifying the measured tokens
        per request) beside ``chunk_tokens`` prompt tokens: the measured step time, rescaled by
        a model of a step: the target pass by SPS(B) (:meth:`SPSTable.pass_seconds`) plus the
        rest of the step (drafting, sampling, verification, commit: Python and small ops per request) in
        proportion to the requests. The rest is what the measured step took beyond the profiled
        pass; without it, the SPS profile alone predicted 32 requests would decode about as fast
        as 2, and they ran ~2x slower (measured here). Without a profile, or with one that cannot
        explain the measured step (a profiled pass longer than the whole step: ``sps_profile:
        off``'s flat table, or a profile from other hardware), in proportion to B (pessimistic).

        Returns:
            seconds (the measured step time, rescaled).
        Raises:
            ValueError: nothing measured yet (``step_s`` is None).
        """
        if self.step_s is None:
            raise ValueError("no decoding step measured yet")
        per_request = self.decode_tokens / max(self.requests, 1e-9)
        batch = per_request * requests + chunk_tokens
        measured_pass = sps.pass_seconds(self.batch_tokens) if sps is not None else None
        if measured_pass is None or measured_pass > self.step_s:
            return self.step_s * batch / max(self.batch_tokens, 1.0)
        rest = (self.step_s - measured_pass) / max(self.requests, 1e-9)
        model_now = measured_pass + rest * self.requests
        model_then = sps.pass_seconds(batch) + rest * requests
        return self.step_s * model_then / model_now

    def allows_one_more(self, floors: list[float], num_admitted: int,
                        sps: SPSTable | None) -> bool:
        """Whether one more request keeps every speed floor: the measured per-request speed at
        the step time predicted for ``num_admitted`` + 1 requests beside the measured prompt
        chunks per step (:meth:`predict_step_s`) stays ``FLOOR_MARGIN`` above the highest floor.
        Always true without floors or with nothing admitted. Before the first measured decoding
        step, one request at a time: an idle engine that let a whole burst of arrivals in at
        once ran them all at the speed of the burst (one of the three causes of a slowest
        request at 3-4 tokens/s among 32 streams under a 12 tokens/s floor; see
        ``benchmarks/results/serve_load/2026-12-06_avx512-bf16.md``).

        Args:
            floors: the floors (tokens/s) of the admitted requests and the newcomer that have one.
            num_admitted: requests decoding or prefilling now (0 with the engine idle).
            sps: the SPS(B) profile; None = step time proportional to the batch (pessimistic
                while memory-bound).
        """
        if not floors or num_admitted == 0:  # an idle engine always serves someone
            return True
        if self.step_s is None:
            return False
        step_s = self.predict_step_s(num_admitted + 1, self.chunk_tokens, sps)
        return self.tokens_per_step / step_s >= max(floors) * (1 + FLOOR_MARGIN)

    def prefill_budget(self, floor: float, num_decoding: int, most: int,
                       sps: SPSTable | None) -> int:
        """Prompt tokens a step may carry beside ``num_decoding`` requests without slowing them
        below ``floor`` (tokens/s) plus ``FLOOR_MARGIN`` (the stall-free chunked prefill of
        Sarathi-Serve, sized by the floor): a chunk whose predicted step fits (the largest one
        where the step time grows with B), at most ``most`` and at least
        ``min(MIN_PREFILL_TOKENS, most)`` so prompts always advance; ``most`` when nothing is
        measured yet or nothing decodes. Measured without it: a burst's prompts (1,918 tokens)
        rode in one 0.88 s step, ten normal steps, and cost every running request a fifth of its
        speed. (A request's drafter context is still extended over its whole prompt in its first
        decoding step; the drafter is a small share of the target's cost.)"""
        if self.step_s is None or num_decoding == 0:
            return most
        longest = self.tokens_per_step / (floor * (1 + FLOOR_MARGIN))  # seconds a step may take
        lo, hi = 0, most
        while lo < hi:  # the largest chunk whose predicted step fits
            mid = (lo + hi + 1) // 2
            if self.predict_step_s(num_decoding, mid, sps) <= longest:
                lo = mid
            else:
                hi = mid - 1
        return max(lo, min(MIN_PREFILL_TOKENS, most))
