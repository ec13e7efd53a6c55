"""What flows into and out of the speculative engine: per-request sampling parameters, requests and
their incremental outputs. Plain dataclasses; the HTTP layer maps OpenAI fields onto them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .errors import RequestError

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by ~1e-38 overflows
# to inf and the softmax to NaN, which must never reach the sampler.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the API's integers (torch and vLLM take int64)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log probability (natural log, raw model distribution) of one emitted token and
    of its most likely alternatives: ``top`` is [(token id, logprob)] best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters.

    max_tokens: hard cap on generated tokens (>= 1); temperature: 0 (or anything below
    ``GREEDY_TEMPERATURE_EPS`` = 1e-5) = greedy, else the sampling temperature of target and
    drafter alike (finite); top_p: nucleus mass in (0, 1]; top_k: keep the k most likely tokens (0
    or -1 = all; a k at or above the vocabulary size keeps all too, as vLLM reads it); min_p: drop
    tokens below min_p times the most likely one's probability (0 = off); seed: seeds this
    request's own RNG (an int64; None = engine-chosen); stop: strings that end the output (not
    included); stop_token_ids: extra token ids that end the output (included, like EOS); logprobs:
    None, or k >= 0: return the target's log probability of every emitted token and of its k most
    likely alternatives (raw model distribution, from the verification pass; at most
    ``MAX_LOGPROBS``); min_tokens: EOS and stop_token_ids cannot be generated before this many
    tokens (the target's distribution is masked there, so speculative decoding stays lossless), and
    a stop string completing within them is output text (vLLM); ignore_eos: EOS does not end the
    output (max_tokens or a stop still does). The sampling warps apply to the target's distribution
    in the order temperature, min_p, top_k, top_p (vLLM's).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None

    def validate(self) -> None:
        """Raises:
            RequestError: a parameter out of range (field named)."""
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}", field="max_tokens")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}",
                               field="temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", field="stop")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise RequestError(f"seed must be a 64-bit integer, got {self.seed}", field="seed")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1 or 0 (all tokens) or >= 1, got {self.top_k}",
                               field="top_k")
        if not (0.0 <= self.min_p <= 1.0):  # also refuses NaN
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                               f"{self.min_tokens}", field="min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
                               field="logprobs")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be token ids >= 0", field="stop_token_ids")

    def normalized(self) -> "SamplingParams":
        """Validated parameters with a temperature below ``GREEDY_TEMPERATURE_EPS`` made exactly
        0 (greedy), as the engine runs them.

        Raises:
            RequestError: see :meth:`validate`.
        """
        self.validate()
        out = self
        if 0 < self.temperature < GREEDY_TEMPERATURE_EPS:
            out = replace(out, temperature=0.0)
        if self.top_k == -1 or self.top_k > INT64_MAX:
            # beyond int64 is beyond any vocabulary: no limit, as every k the vocabulary cannot
            # fill is (vLLM; drafters.sampling.warped_probs), and never a tensor overflow
            out = replace(out, top_k=0)
        return out


@dataclass
class EngineRequest:
    """A request handed to :meth:`serve.engine.core.SpecEngine.add_request`.

    prompt_ids: the rendered prompt (chat template already applied), non-empty.
    return_spec_details: attach the request's speculation summary to its finished output
    (:func:`serve.engine.metrics.request_spec_details`).
    spec_decode_metrics: ``"summary"`` / ``"detailed"`` attach vLLM's per-request acceptance
    stats to its finished output (:func:`serve.engine.metrics.vllm_spec_decode_metrics`);
    ``"none"``: not.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_spec_details: bool = False
    spec_decode_metrics: str = "none"  # serve.engine.metrics.SpecDecodeMetricsLevel
    # per-user speed floor in tokens/s (EngineConfig.min_tokens_per_s); None = the engine's
    min_tokens_per_s: float | None = None


@dataclass
class RequestOutput:
    """What one engine step produced for one request.

    new_token_ids: tokens committed this step (after stop truncation); new_text: their text delta
    (never splits a multi-byte character, never repeats earlier text, excludes a matched stop
    string); finished / finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"``
    (max_tokens), ``"abort"`` or ``"error"``; num_prompt_tokens / num_generated_tokens: usage so
    far (emitted tokens only); error: why the request failed (finish_reason "error"), else None.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    error: RequestError | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked
    # on the finished output of a request that asked (return_spec_details): its speculation
    # summary, serve.engine.metrics.request_spec_details
    spec_details: dict | None = None
    # on the finished output of a request that asked (spec_decode_metrics): vLLM's per-request
    # ``metrics`` object, {"speculative_decoding": serve.engine.metrics.vllm_spec_decode_metrics}
    metrics: dict | None = None
