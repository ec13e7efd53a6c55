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


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters.

    max_tokens: hard cap on generated tokens (>= 1); temperature: 0 (or anything below
    ``GREEDY_TEMPERATURE_EPS`` = 1e-5) = greedy, else the sampling temperature of target and
    drafter alike (finite); top_p: nucleus mass in (0, 1]; seed: seeds this
    request's own RNG (None = engine-chosen); stop: strings that end the output (not included);
    stop_token_ids: extra token ids that end the output (included, like EOS).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

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

    def normalized(self) -> "SamplingParams":
        """Validated parameters with a temperature below ``GREEDY_TEMPERATURE_EPS`` made exactly
        0 (greedy), as the engine runs them.

        Raises:
            RequestError: see :meth:`validate`.
        """
        self.validate()
        if 0 < self.temperature < GREEDY_TEMPERATURE_EPS:
            return replace(self, temperature=0.0)
        return self


@dataclass
class EngineRequest:
    """A request handed to :meth:`serve.engine.SpecEngine.add_request`.

    prompt_ids: the rendered prompt (chat template already applied), non-empty.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


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
