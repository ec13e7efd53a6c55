"""Serving configuration of the Ray Serve application (YAML + pydantic, validated, never executed).

``ServeConfig`` is the ``args`` of ``serve.app:build_app``; its ``engine:`` block is the engine's
own :class:`serve.engine.config.EngineConfig`, shared with offline evaluation and benchmarks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .engine.config import EngineConfig, deprecated_name
from .engine.metrics import SpecDecodeMetricsLevel

logger = logging.getLogger(__name__)


class VllmBackendConfig(BaseModel):
    """``backend: vllm``: the same model served by vLLM through ``ray.serve.llm`` (the path for
    GPU fleets; ``serve/vllm_app.py``). The drafter is a ``python -m drafters.export --format
    vllm`` directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    drafter_export: str | None = Field(None, description="Exported drafter directory (relative: "
                                       "project root); null serves the target alone.")
    adaptive_verification: bool = Field(True, description="vLLM's DSpark adaptive verification: "
                                        "each request's verification sized by the confidence "
                                        "head (needs one in the export).")
    num_gpus_per_replica: int = Field(1, ge=1, description="Tensor-parallel GPUs per replica.")
    min_replicas: int = Field(1, ge=0, description="Autoscaling lower bound.")
    max_replicas: int = Field(1, ge=1, description="Autoscaling upper bound.")
    target_ongoing_requests: int = Field(32, ge=1, description="Autoscaling target per replica.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM's share of each GPU.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Further vLLM "
                                          "engine arguments, passed through unchanged.")

    @model_validator(mode="after")
    def _replicas(self) -> "VllmBackendConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas "
                             f"{self.max_replicas}")
        return self


class ServeConfig(BaseModel):
    """The ``args`` of the Serve application (``build_app``). Relative paths resolve against the
    project root (``serve.engine.paths.resolve``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(description="`from_pretrained` name or directory of the target; a value "
                        "starting with '.', '/' or '~' is a path (relative: project root).")
    drafter: str | None = Field(None, description="Drafter checkpoint directory (relative: project "
                                "root) or URL (s3://..., fetched by each replica); null serves "
                                "the target alone.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="s3fs options for "
                                            "an s3:// drafter (endpoint_url, key, secret, ...).")
    allow_target_name_mismatch: bool = Field(
        False, description="Serve a drafter whose recorded target has another name (a renamed "
        "copy of the same model); shapes are always checked.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Target and drafter dtype; auto = bf16 where the replica's device "
        "multiplies it natively (CUDA, AVX-512-BF16 / AMX CPUs), fp32 otherwise "
        "(drafters/precision.py).")
    served_model_name: str | None = Field(None, description="The `model` clients send; default: "
                                          "the target's name (a path's last component).")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"enable_thinking": False},
        description="Extra chat-template variables; must equal the ones the training data used.")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads per replica "
                                    "(CPU); None = torch's default.")
    num_cpus: float = Field(1.0, gt=0, description="Logical CPUs Ray reserves per replica.")
    heap_trim_interval_s: float = Field(
        10.0, ge=0, description="Seconds between returns of the allocator's free memory to the "
        "OS (glibc malloc_trim, serve/heap.py), so resident memory follows use instead of each "
        "thread arena's high-water mark; 0 disables.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per replica (fractions "
                            "share one); > 0 puts target and drafter on CUDA, and a replica that "
                            "asked for a GPU but sees none fails at start-up.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where target and drafter run: auto = cuda when num_gpus > 0, else "
        "cpu. cuda with num_gpus 0 is refused (Ray would not schedule the replica on a GPU).")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request omits it "
                                    "(tokens); clipped to the room left in the model length.")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Ray Serve's per-replica concurrency cap (requests); None = "
        "engine.max_num_requests + engine.max_waiting + 16, so the engine's own admission control "
        "answers 429 before Serve queues anything.")
    metrics_interval_s: float = Field(1.0, gt=0, description="Seconds between engine-counter "
                                      "exports to Ray's metrics.")
    per_request_spec_decode_metrics: SpecDecodeMetricsLevel = Field(
        "none", description="vLLM's --per-request-spec-decode-metrics: summary puts vLLM's "
        "per-request acceptance stats (`metrics.speculative_decoding`) in every response (the "
        "usage chunk when streaming), detailed adds per-step lists; none: only in responses to "
        "requests that set return_spec_details (summary). backend vllm: pass vLLM's own "
        "frontend flag instead.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    backend: Literal["dspark-ray", "vllm"] = Field(
        "dspark-ray", description="dspark-ray: this project's engine (the reference, and the CPU "
        "path); vllm: vLLM through ray.serve.llm with the exported drafter (GPU fleets).")
    vllm: VllmBackendConfig = Field(default_factory=VllmBackendConfig)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """vllm.num_speculative_tokens is engine.num_speculative_tokens now (one serving cap
        for both backends); the dspark-ray backend ignored it, and still does."""
        vllm = data.get("vllm") if isinstance(data, dict) else None
        if not isinstance(vllm, dict) or "num_speculative_tokens" not in vllm:
            return data
        data = {**data, "vllm": {k: v for k, v in vllm.items() if k != "num_speculative_tokens"}}
        if data.get("backend", "dspark-ray") != "vllm":
            logger.warning("vllm.num_speculative_tokens is deprecated and ignored by backend %s "
                           "(the cap is engine.num_speculative_tokens)", data.get("backend",
                                                                                  "dspark-ray"))
            return data
        engine = data.get("engine") or {}
        if not isinstance(engine, dict):  # an EngineConfig object: merged through its fields
            engine = engine.model_dump(exclude_unset=True)
        if engine.get("num_speculative_tokens") is not None:
            raise ValueError("vllm.num_speculative_tokens is the old place of "
                             "engine.num_speculative_tokens: set only the engine's")
        deprecated_name("vllm.num_speculative_tokens", "engine.num_speculative_tokens")
        return {**data, "engine": {**engine,
                                   "num_speculative_tokens": vllm["num_speculative_tokens"]}}

    @model_validator(mode="after")
    def _device_matches_gpus(self) -> "ServeConfig":
        if self.device == "cuda" and self.num_gpus == 0:
            raise ValueError("device 'cuda' needs num_gpus > 0 (Ray places the replica on a GPU "
                             "only when it reserves one)")
        if self.device == "cpu" and self.num_gpus > 0:
            raise ValueError("num_gpus > 0 with device 'cpu' reserves a GPU the replica never uses")
        return self

    def torch_device(self) -> str:
        """"cuda" or "cpu" for this replica."""
        return "cuda" if self.device == "cuda" or (self.device == "auto" and self.num_gpus > 0) \
            else "cpu"

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.target).name if _is_path(self.target) else self.target


def _is_path(name_or_path: str) -> bool:
    return name_or_path.startswith((".", "/", "~"))
