"""Engine and serving configuration (YAML + pydantic, validated, never executed).

``EngineConfig`` is the one block of engine knobs shared by offline evaluation, benchmarks and the
Ray Serve app (STYLE: engine kwargs are not repeated across configs).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SchedulerName = Literal["dspark", "async", "static_threshold", "fixed", "none"]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    scheduler: SchedulerName = Field("dspark", description="Verification-length policy (SPEC 6): "
                                     "dspark (Algorithm 1), async (section 5.2), static_threshold, "
                                     "fixed (gamma) or none (target only).")
    num_draft_tokens: int | None = Field(None, ge=1, description="Tokens drafted per round; None = "
                                         "the drafter's block size gamma. Also fixed's length.")
    threshold: float = Field(0.5, ge=0.0, le=1.0, description="static_threshold: verify while "
                             "the prefix survival a_k >= threshold.")
    max_num_requests: int = Field(32, ge=1, description="Requests decoded together (batch).")
    max_batch_tokens: int = Field(512, ge=1, description="Cap on tokens verified per step, all "
                                  "requests together (also the SPS profile's range).")
    max_waiting: int = Field(256, ge=0, description="Queued requests beyond the batch before new "
                             "ones are refused (HTTP 429).")
    max_model_len: int | None = Field(None, ge=16, description="Prompt + max_tokens limit in "
                                      "tokens; None = the target's max_position_embeddings.")
    sps_profile: Literal["auto", "off"] = Field("auto", description="auto: profile SPS(B) at start-up "
                                                "(or reuse a stored profile for this hardware and "
                                                "model); off: assume SPS constant (B-independent).")
    sps_repeats: int = Field(3, ge=1, description="Timed forward passes per batch size when profiling.")
