"""Per-request state of the speculative engine (``serve/engine/core.py``): what a request carries
from step to step, the record of each of its verification rounds, and its offline result.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from .detokenize import IncrementalDetokenizer
from .draft_planner import AcceptanceEstimate
from .lookup import NgramIndex
from .requests import EngineRequest
from .target_runner import TargetKV


@dataclass
class RoundRecord:
    """One verification round of one request: ``drafted`` tokens proposed, ``verified`` l of them
    sent to the target, ``accepted`` n, ``committed`` tokens emitted (n + 1, or fewer when a stop
    or the token budget ends the round), the step's draft and verify seconds, and the raw
    confidence logits z_1..z_drafted (None without a confidence head)."""

    drafted: int
    verified: int
    accepted: int
    committed: int
    draft_s: float
    verify_s: float
    confidence_logits: list[float] | None = None
    source: str | None = None  # "model" (the drafter), "lookup" (prompt lookup) or None


@dataclass
class PendingContext:
    """Committed positions not yet in the drafter's context (extended lazily, right before the
    request is next drafted for, so a step that drafts nothing costs no drafter work)."""

    features: list = field(default_factory=list)  # [n_i, m*H_t] each
    start: int = 0  # position of the first pending row
    tokens: list = field(default_factory=list)  # the token after each pending position


@dataclass
class RequestState:
    """One request inside the engine, from ``add_request`` to its last token.

    ``gen`` is the request's own RNG (seeded by its seed, or an engine-chosen one) and ``detok``
    its detokenizer (None: token ids only). The planner's view of it
    (``serve/engine/step_plan.py``): the acceptance estimates of the drafter and of prompt lookup,
    steps since the drafter last drafted for it and the back-off until its next probe.
    """

    req: EngineRequest
    gen: torch.Generator
    detok: IncrementalDetokenizer | None
    kv: TargetKV = field(default_factory=TargetKV)
    draft_state: object = None  # the drafter's context (None until its first prefill chunk)
    anchor: int = -1
    pos: int = 0  # position of the anchor (committed, not yet run through the target)
    prefilled: int = 0  # prompt tokens already in the target cache (chunked prefill)
    pending: PendingContext = field(default_factory=PendingContext)
    model_acc: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    lookup_acc: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    lookup: NgramIndex | None = None
    skipped: int = 0  # steps since the planner last let the drafter draft for this request
    backoff: int = 1  # steps until the next probe
    output: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    rounds: list = field(default_factory=list)
    arrival_s: float = 0.0
    first_token_s: float | None = None

    @classmethod
    def create(cls, request: EngineRequest, tokenizer=None) -> RequestState:
        """A request arriving now: its RNG seeded by its seed (an engine-chosen one without),
        and a detokenizer for its text and stop strings when there is a ``tokenizer``."""
        p = request.params
        seed = p.seed if p.seed is not None else random.getrandbits(63)
        detok = (IncrementalDetokenizer(tokenizer, request.prompt_ids, tuple(p.stop),
                                        min_tokens=p.min_tokens)
                 if tokenizer is not None else None)
        return cls(request, torch.Generator().manual_seed(seed), detok,
                   arrival_s=time.perf_counter())


@dataclass
class Completion:
    """A finished request (offline :meth:`SpecEngine.generate`): tokens (EOS included when it
    ended the output), text, finish_reason, rounds, time to first token and total seconds."""

    request_id: str
    tokens: list[int]
    text: str
    finish_reason: str
    rounds: list[RoundRecord]
    first_token_s: float
    total_s: float
