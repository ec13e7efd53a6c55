"""Engine configuration (YAML + pydantic, validated, never executed).

``EngineConfig`` is the one block of engine knobs shared by offline evaluation, benchmarks and the
Ray Serve app (STYLE: engine kwargs are not repeated across configs).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .scheduler_registry import NEEDS_SPS, SCHEDULER_NAMES

SchedulerName = Literal[SCHEDULER_NAMES]  # type: ignore[valid-type]  (names from the registry)
logger = logging.getLogger(__name__)


def deprecated_name(old: str, new: str) -> None:
    """Say (warning and log) that config field ``old`` is read as its new name ``new``."""
    msg = f"{old} is deprecated: it is now {new} (same meaning)"
    warnings.warn(msg, DeprecationWarning, stacklevel=3)
    logger.warning(msg)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    scheduler: SchedulerName = Field("dspark", description="Verification-length policy (SPEC 6): "
                                     "dspark (Algorithm 1), async (section 5.2), static_threshold, "
                                     "fixed (num_speculative_tokens every round) or none "
                                     "(target only).")
    num_speculative_tokens: int | None = Field(
        None, ge=1, description="The serving cap: draft tokens per round at most (vLLM's name); "
        "None = the drafter's block_size (backend vllm: the export's). Also fixed's length. "
        "Formerly num_draft_tokens (still read, with a deprecation message).")
    threshold: float = Field(0.5, ge=0.0, le=1.0, description="static_threshold: verify while "
                             "the prefix survival a_k >= threshold.")
    draft_planning: Literal["goodput", "off"] = Field(
        "goodput", description="dspark/async: before drafting, predict each request's acceptance "
        "from its past rounds and draft only for the requests (and only as many tokens) that raise "
        "the step's expected tokens/s once the drafter's profiled cost is counted "
        "(serve/engine/draft_planner.py); off = draft num_speculative_tokens tokens for every "
        "request every step.")
    fill_passes: bool = Field(True, description="dspark/async: plan with the SPS(B) profile's "
                              "upper envelope (up to the pass the proposed drafts allow) and fill "
                              "each target pass with more draft tokens "
                              "up to the fastest length at or above the scheduled one (lossless; "
                              "pays where the measured curve is jagged, e.g. fp32 on AVX2 CPUs, "
                              "where a pass of 2 to 4 tokens is slower than one of 8); false = "
                              "plan and verify on the measured curve as it is.")
    probe_interval: int = Field(4, ge=1, description="goodput planning: a request the planner "
                                "keeps from the drafter is drafted for again after N steps (a "
                                "lossless probe); the interval doubles while probes keep saying "
                                "no, up to max_probe_interval.")
    max_probe_interval: int = Field(64, ge=1, description="Longest probe back-off (steps).")
    min_draft_gain: float = Field(0.05, ge=0.0, le=1.0, description="goodput planning: draft "
                                  "only when the plan promises at least this relative gain in "
                                  "tokens/s over drafting for nobody (a margin for what the "
                                  "profiles leave out: rejection sampling of draft tokens, "
                                  "streaming); 0 = any predicted gain.")
    probe_budget: float = Field(0.03, ge=0.0, le=1.0, description="goodput planning: the share of "
                                "a target-only step's time that probes may add to drafting, on "
                                "average (predicted from the profiles); due probes beyond it "
                                "wait and are drafted together once it allows (under load they "
                                "batch instead of taxing every step); 0 = no probes unless free.")
    probe_alpha: float = Field(0.8, gt=0.0, le=1.0, description="goodput planning: probes "
                               "are drafted only in steps where a request accepting this share "
                               "of its draft tokens would be drafted for (under load on a CPU "
                               "even good drafts do not pay, so a probe's answer could not "
                               "change the plan and it would only cost); 1.0 = whenever a "
                               "perfect draft would pay.")
    prompt_lookup_max_ngram: int = Field(
        0, ge=0, le=16, description="goodput planning: also consider a prompt-lookup draft (the "
        "tokens that followed the latest earlier occurrence of the request's last n tokens, n "
        "from this down to prompt_lookup_min_ngram) and verify it instead of drafting when its "
        "predicted accepted length is at least the drafter's; 0 = off. Lossless (one-hot draft "
        "distribution).")
    prompt_lookup_min_ngram: int = Field(2, ge=1, le=16, description="Shortest n-gram matched.")
    seeded_sampling: Literal["load_invariant", "rejection"] = Field(
        "load_invariant", description="How a request with a seed samples when a drafter is "
        "loaded. load_invariant: every output position is a Gumbel-max draw keyed by (seed, "
        "position) and a draft is accepted iff it equals that draw, so the output is the same "
        "whatever is drafted, and so whatever else the server is doing (lossless; it accepts "
        "somewhat less than rejection sampling: >= (1 - TV) / (1 + TV) instead of 1 - TV). "
        "rejection: speculative rejection sampling from the request's own random stream (the most "
        "acceptance, but the output depends on the drafting plan, which depends on load); for "
        "offline use one request at a time. Unseeded requests always use rejection sampling.")
    min_tokens_per_s: float | None = Field(
        None, gt=0, description="Per-user speed floor (tokens/s) for every request (a request's "
        "own min_tokens_per_s overrides it); None = none. With a confidence-based scheduler, "
        "verification goes first to requests predicted below their floor "
        "(serve.engine.plan_extensions.hold_speed_floors, lossless), a waiting request is admitted "
        "only while the engine's measured speed per request, rescaled to one more request "
        "(serve.engine.admission.Pace.predict_step_s: the SPS(B) pass plus the per-request rest "
        "of a step), holds this floor (otherwise it queues; a full queue answers 429), and a "
        "step carries only the prompt tokens that keep the decoding requests above it (at least "
        "MIN_PREFILL_TOKENS). A request's own floor orders verification only (it neither gates "
        "admission nor sizes prompt chunks). Needs scheduler dspark or async (profiled SPS).")
    attention: Literal["kernel", "pytorch"] = Field(
        "kernel", description="How decode and verify rows attend the KV cache on a CPU. kernel: "
        "one call of the decode attention kernel for all of them (serve/engine/csrc, compiled "
        "for this CPU on first use, ~30 s once; where it cannot be built a warning says so and "
        "pytorch is used); pytorch: batched products and per-request SDPA calls. Same results "
        "up to rounding; on a GPU always pytorch.")
    max_num_requests: int = Field(32, ge=1, description="Requests decoded together (batch).")
    max_prefill_tokens: int = Field(2048, ge=1, description="Prompt tokens prefilled per step "
                                    "(chunked prefill): a longer prompt, or several, continue in "
                                    "the next steps while the running requests keep decoding.")
    max_batch_tokens: int = Field(512, ge=1, description="Cap on tokens verified per step, all "
                                  "requests together (also the SPS profile's range).")
    max_waiting: int = Field(256, ge=0, description="Queued requests beyond the batch before new "
                             "ones are refused (HTTP 429).")
    max_model_len: int | None = Field(None, ge=16, description="Prompt + max_tokens limit in "
                                      "tokens; None = the target's max_position_embeddings.")
    kv_cache_memory_gib: float = Field(2.0, gt=0, description="Target KV pool allocated at "
                                       "start-up (GiB): max_num_requests slots of max_model_len + "
                                       "a draft block positions; when that exceeds this budget, "
                                       "the slots hold fewer positions and the model length "
                                       "shrinks to match (a warning says so; /health reports the "
                                       "pool).")
    sps_profile: Literal["auto", "off"] = Field("auto", description="auto: profile SPS(B) at start-up "
                                                "(or reuse a stored profile for this hardware and "
                                                "model); off: assume SPS constant (B-independent).")
    sps_repeats: int = Field(3, ge=1, description="Timed forward passes per batch size when profiling.")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "num_draft_tokens" not in data:
            return data
        if data.get("num_speculative_tokens") is not None:
            raise ValueError("num_draft_tokens is the old name of num_speculative_tokens: set "
                             "only num_speculative_tokens")
        deprecated_name("engine.num_draft_tokens", "engine.num_speculative_tokens")
        data = dict(data)
        data["num_speculative_tokens"] = data.pop("num_draft_tokens")
        return data

    @model_validator(mode="after")
    def _check_lookup(self) -> "EngineConfig":
        if self.prompt_lookup_max_ngram and self.prompt_lookup_min_ngram > self.prompt_lookup_max_ngram:
            raise ValueError(f"prompt_lookup_min_ngram ({self.prompt_lookup_min_ngram}) exceeds "
                             f"prompt_lookup_max_ngram ({self.prompt_lookup_max_ngram})")
        if self.max_probe_interval < self.probe_interval:
            raise ValueError(f"max_probe_interval ({self.max_probe_interval}) is below "
                             f"probe_interval ({self.probe_interval})")
        if self.min_tokens_per_s is not None and self.scheduler not in NEEDS_SPS:
            # the floors are read against the SPS(B) table only these schedulers are given
            raise ValueError(f"min_tokens_per_s needs scheduler dspark or async (an SPS(B) "
                             f"table), got {self.scheduler!r}")
        return self

    def speculative_tokens(self, block_size: int) -> int:
        """The cap in effect (the engine's ``num_speculative_tokens``): draft tokens per round at
        most, the drafter's block_size unless num_speculative_tokens is smaller (the one place
        this is derived)."""
        return min(block_size, self.num_speculative_tokens or block_size)

    @property
    def plans_drafts(self) -> bool:
        """Whether the goodput planner (with its SPS table and drafter cost) is in use."""
        return self.draft_planning == "goodput" and self.scheduler in NEEDS_SPS
