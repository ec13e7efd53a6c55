"""Typed pipeline configuration: YAML validated with pydantic, ``--set section.field=value``
overrides, unknown keys rejected with their dotted name, every invalid field listed at once.

Configs are data (YAML through ``yaml.safe_load``), never executed Python.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from drafters.config import DrafterConfig
from drafters.losses import OBJECTIVES
from serve.engine.config import EngineConfig

from .overrides import ConfigError, format_validation_error, parse_override, set_dotted

# "auto": bf16 where the computing process's device multiplies it natively (CUDA, AVX-512-BF16 or
# AMX CPUs), fp32 otherwise (drafters/precision.py); an explicit dtype always wins
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RayConfig(Strict):
    address: str | None = Field(None, description="Cluster address; None starts (or joins, inside "
                                "`ray job submit`) a local Ray.")
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs of a locally started Ray "
                                 "(more than the cores lets Ray Data read while trainers run).")


class GGUFSource(Strict):
    package: str = Field(description="Import name of the PyPI package carrying the GGUF.")
    file: str = Field(description="GGUF file inside the package.")


class TargetConfig(Strict):
    name_or_path: str = Field(description="`from_pretrained` name or directory of the target.")
    convert_from_gguf: GGUFSource | None = Field(
        None, description="Materialise name_or_path once from a packaged GGUF if it is missing.")
    dtype: Dtype = "auto"
    layer_ids: list[int] | None = Field(None, description="Target layers of the context features; "
                                        "None = evenly spaced from 1 to L-3 (SPEC 1.4).")
    num_context_layers: int = Field(5, ge=1, le=16)
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"enable_thinking": False},
        description="Extra chat-template variables; the same ones are used by generation, cache, "
                    "evaluation and serving.")

    @field_validator("layer_ids")
    @classmethod
    def _ascending(cls, v):
        if v is not None and (sorted(set(v)) != v or min(v) < 0):
            raise ValueError(f"layer_ids must be distinct, ascending and >= 0, got {v}")
        return v


class PromptSource(Strict):
    path: str = Field(description="JSONL or Parquet file, local or s3://.")
    max_rows: int | None = Field(None, ge=1, description="Seeded random subset of this size.")


class PromptsConfig(Strict):
    sources: list[PromptSource] = Field(min_length=1)
    heldout_fraction: float = Field(0.05, ge=0.0, lt=0.9)
    heldout_ids_from: str | None = Field(
        None, description="A JSONL (.jsonl.gz) or Parquet file whose rows' ids are the held-out "
        "split (e.g. an earlier run's prompts/heldout.jsonl), instead of heldout_fraction: a run "
        "that grows its sources keeps the held-out prompts it is compared on.")
    seed: int = 0


class SamplingConfig(Strict):
    temperature: float = Field(0.7, ge=0.0)
    top_p: float = Field(0.8, gt=0.0, le=1.0)
    top_k: int = Field(20, ge=0)
    max_new_tokens: int = Field(4096, ge=1)


# engine arguments the vllm section (or the pipeline) sets itself; engine_kwargs may not repeat them
VLLM_DERIVED_ENGINE_KWARGS = {
    "model": "target.name_or_path", "tokenizer": "target.name_or_path", "dtype": "target.dtype",
    "seed": "seed", "max_model_len": "generate.max_prompt_tokens + sampling.max_new_tokens",
    "task_type": "(always generate)",
    "tensor_parallel_size": "generate.vllm.tensor_parallel_size",
    "max_num_seqs": "generate.vllm.max_num_seqs",
    "max_num_batched_tokens": "generate.vllm.max_num_batched_tokens",
    "gpu_memory_utilization": "generate.vllm.gpu_memory_utilization",
}


class VllmGenerateConfig(Strict):
    """``generate.backend: vllm``: the engines of the ``ray.data.llm`` processor
    (``pipeline/generate/vllm_backend.py``). Sampling, chat template and prompt limit are the shared
    ``generate`` / ``target`` fields, mapped to the same meaning as the hf backend's."""

    num_replicas: int = Field(1, ge=1, description="vLLM engines (a fixed Ray Data actor pool), "
                              "each on tensor_parallel_size GPUs.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (tensor parallel).")
    batch_size: int = Field(64, ge=1, description="Conversations per batch sent to an engine.")
    max_concurrent_batches: int = Field(8, ge=1, description="Batches in flight per engine; "
                                        "batch_size x this should reach max_num_seqs.")
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences an engine decodes "
                                     "together; None = vLLM's default for the GPU.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens per engine step "
                                               "(chunked prefill budget); None = vLLM's default.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM's share of each "
                                          "GPU (weights + KV cache).")
    accelerator_type: str | None = Field(None, description="Ray accelerator type the engines "
                                         "need (e.g. H100); None = any GPU.")
    placement_group_config: dict[str, Any] | None = Field(
        None, description="Ray Data LLM's placement group per engine ({bundles: [...], strategy: "
        "...}); None = tensor_parallel_size x {GPU: 1, CPU: 1}. {bundles: [{CPU: 1}]} runs a "
        "CPU build of vLLM (tests).")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Further vLLM "
                                          "engine arguments, passed through unchanged.")

    @field_validator("engine_kwargs")
    @classmethod
    def _not_derived(cls, v):
        clash = sorted(set(v) & set(VLLM_DERIVED_ENGINE_KWARGS))
        if clash:
            raise ValueError("engine_kwargs may not set " + ", ".join(
                f"{k} (comes from {VLLM_DERIVED_ENGINE_KWARGS[k]})" for k in clash))
        return v


class GenerateConfig(Strict):
    backend: Literal["hf", "engine", "vllm"] = Field(
        "hf", description="hf: the target in transformers inside a Ray Data actor pool, padded "
        "batches (embedded, CPU or GPU; batch_size, num_actors, cpus/gpus_per_actor, "
        "num_threads); engine: the same actor pool decoding with this project's continuous-"
        "batching engine in target-only mode (max_num_requests sequences in flight, "
        "kv_cache_memory_gib; tokens/s against hf: benchmarks/results/gen_throughput/2026-12-02_unrecorded.md); "
        "vllm: a ray.data.llm vLLM processor for GPU clusters (the vllm section; needs vLLM "
        "installed). All write the same rows.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    batch_size: int = Field(8, ge=1, description="backends hf / engine: prompts per Ray Data "
                            "batch (hf: one padded generation, written when done; engine: "
                            "queued at once, finished conversations written about every "
                            "minute while the batch decodes).")
    num_actors: int = Field(1, ge=1, description="backends hf / engine: generation actors.")
    cpus_per_actor: float = Field(1.0, gt=0, description="backends hf / engine.")
    gpus_per_actor: float = Field(0.0, ge=0, description="backends hf / engine.")
    num_threads: int | None = Field(None, ge=1, description="backends hf / engine: torch threads "
                                    "per actor on CPU.")
    max_num_requests: int = Field(128, ge=1, description="backend engine: sequences decoded "
                                  "together per actor (continuous batching).")
    kv_cache_memory_gib: float = Field(4.0, gt=0, description="backend engine: KV pool per actor "
                                       "(GiB); must hold max_num_requests x (max_prompt_tokens + "
                                       "sampling.max_new_tokens) positions.")
    max_prompt_tokens: int = Field(2048, ge=8, description="Longer prompts go to the error file "
                                   "(both backends).")
    vllm: VllmGenerateConfig = Field(default_factory=VllmGenerateConfig,
                                     description="Engines of backend vllm (read only there).")
    reuse_from: list[str] = Field(
        default_factory=list, description="Files of conversations an earlier run regenerated with "
        "the same target and sampling (its generate/<split>.jsonl, or a shipped copy, .jsonl.gz "
        "too): a prompt whose id and user turns match one of their rows takes that row instead "
        "of being regenerated (all backends).")


# Limits of the cache's row groups (why: pipeline/cache/writer.py, above row_group_sizes): one Arrow
# binary column, or one value, holds at most MAX_COLUMN_BYTES; row groups default to far less
MAX_COLUMN_BYTES = 2**31 - 2**26
DEFAULT_ROW_GROUP_BYTES = 2**29  # 512 MiB
DEFAULT_FORWARD_BATCH_TOKENS = 8192  # padded tokens per batched target forward of the cache stage


class CacheConfig(Strict):
    output: str | None = Field(None, description="Local path or s3:// URL; default <run_dir>/cache.")
    max_length: int = Field(4096, ge=16)
    min_supervised_tokens: int = Field(14, ge=2)
    rows_per_shard: int = Field(64, ge=1)
    rows_per_row_group: int = Field(16, ge=1)
    row_group_bytes: int = Field(DEFAULT_ROW_GROUP_BYTES, ge=2**20, le=MAX_COLUMN_BYTES,
                                 description="Most uncompressed bytes (all columns) in one "
                                 "Parquet row group; a larger sample goes alone. Bounds the "
                                 "writer's and each training reader's memory and keeps every "
                                 "column under Arrow binary's 2 GiB.")
    forward_batch_tokens: int = Field(DEFAULT_FORWARD_BATCH_TOKENS, ge=1, description="Padded "
                                      "tokens per target forward: "
                                      "the samples of a row group go through the target in "
                                      "batches of similar length up to this many tokens "
                                      "(a longer sample goes alone; 1 = one sample per forward).")
    num_actors: int = Field(1, ge=1)
    cpus_per_actor: float = Field(1.0, gt=0)
    gpus_per_actor: float = Field(0.0, ge=0)
    num_threads: int | None = Field(None, ge=1)


class TrainConfig(Strict):
    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement of the training workers: PACK fills a node first "
        "(fastest all-reduce); STRICT_SPREAD puts each worker on its own node.")
    num_threads: int | None = Field(None, ge=1, description="torch threads per worker on CPU.")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per worker per micro-step.")
    global_batch_size: int = Field(512, ge=1, description="Sequences per optimizer step.")
    num_epochs: int = Field(10, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    grad_clip: float = Field(1.0, gt=0)
    num_anchors: int = Field(512, ge=1)
    zero_stage: Literal[0, 1, 2] = 1
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16 = autocast forward with fp32 master weights and optimizer "
        "state; auto = bf16 where the training worker's device multiplies bf16 natively, else "
        "fp32 (drafters/precision.py).")
    loss_weights: tuple[float, float, float] = Field((0.1, 0.9, 1.0),
                                                     description="(ce, tv, conf), Eq. 12.")
    objective: Literal[OBJECTIVES] | None = Field(  # type: ignore[valid-type]
        None, description="Training loss instead of the drafter type's own (DSpark: the Eq. 12 "
        "mix; DFlash: ce; Eagle3: soft_ce); ce and soft_ce keep loss_weights' confidence term.")
    loss_chunk_rows: int = Field(1024, ge=1, description="Supervised rows per chunk of the "
                                 "vocabulary-sized loss work (recomputed in backward unless a "
                                 "draft vocabulary is used and all rows fit one chunk).")
    log_every: int = Field(1, ge=1)
    eval_every: int | None = Field(None, ge=1, description="Held-out losses, tau and "
                                   "accept_rate@k every N steps (and at the end); None = never.")
    eval_rows: int = Field(64, ge=1, description="Held-out cache rows used by eval_every.")
    plateau_patience: int | None = Field(None, ge=1, description="Train to the plateau: stop "
                                         "once held-out tau has not risen by plateau_min_delta "
                                         "over its best for this many evaluations in a row "
                                         "(needs eval_every); None = run max_steps / num_epochs.")
    plateau_min_delta: float = Field(0.01, ge=0, description="Smallest rise of held-out tau "
                                     "(tokens per round) that counts as progress.")
    max_train_rows: int | None = Field(None, ge=1, description="Train on a subset of the cache's "
                                       "training rows: whole shards drawn in a seeded order "
                                       "(``seed``) until at least this many rows, so a smaller "
                                       "subset is part of every larger one (data-scaling "
                                       "curves); None = all. Held-out rows are never cut.")
    verify_cache: bool = Field(True, description="Check every cache shard against the manifest's "
                               "sha256 (and its row count and schema) before training starts, so a "
                               "damaged shard is named up front instead of failing a worker later; "
                               "reads the whole cache once (switch off for a multi-TB cache that "
                               "was verified when written).")
    checkpoint_every: int | None = Field(None, ge=1, description="Resumable checkpoint every N "
                                         "steps; the final step is always checkpointed.")
    resume_from: str | None = Field(None, description="'latest' (this run's newest checkpoint, "
                                    "if any) or a checkpoint directory: continue model, optimizer, "
                                    "LR schedule and data position; the worker count may differ.")
    init_from: str | None = Field(None, description="A drafter directory whose weights start a "
                                  "NEW training (fresh optimizer, schedule and data order).")
    max_bad_steps: int = Field(3, ge=0, description="Consecutive optimizer steps with a "
                               "non-finite loss (on any worker) that are skipped and counted as "
                               "skipped_steps; one more aborts the run, leaving the checkpoints "
                               "written before intact. 0 = abort at the first.")
    max_failures: int = Field(0, ge=-1, description="Ray Train worker-group restarts after a "
                              "worker dies (from the newest checkpoint; -1 = unlimited). Pair "
                              "with checkpoint_every: without one a restart begins at step 0.")
    num_to_keep: int | None = Field(None, ge=1, description="Newest checkpoints kept on storage; "
                                    "None keeps all.")
    storage_path: str | None = Field(None, description="Where Ray Train writes checkpoints, under "
                                     "<storage_path>/<run_dir name>/: a shared filesystem path or "
                                     "s3:// URL, which every node of a multi-node run needs; None "
                                     "= <run_dir>/train/ray_train (the head's disk, single node).")
    data_mode: Literal["offline", "online", "hybrid"] = Field(
        "offline", description="Where the target features come from. offline: the cache "
        "stage's Parquet shards. online: a Ray Data pipeline of target actors (sized by the "
        "cache: section's num_actors / cpus_per_actor / gpus_per_actor) computes them from the "
        "generate output every epoch and streams them into the trainers; nothing is stored. "
        "hybrid: the first epoch streams and writes the cache as it goes, later epochs read it.")
    stream_object_store_gib: float = Field(2.0, gt=0, description="online/hybrid: object-store "
                                           "memory Ray Data may fill with streamed features "
                                           "before the feature actors wait (back-pressure).")
    stream_shuffle_rows: int = Field(64, ge=0, description="online/hybrid: each trainer's local "
                                     "shuffle buffer over the streamed rows (0 = stream order).")
    seed: int = 0

    @model_validator(mode="after")
    def _subset_is_offline(self):
        if self.max_train_rows is not None and self.data_mode != "offline":
            raise ValueError("train.max_train_rows cuts the cache's shards: it needs "
                             "train.data_mode offline")
        return self

    @model_validator(mode="after")
    def _resume_or_init(self):
        if self.resume_from and self.init_from:
            raise ValueError("set train.resume_from (continue a run) or train.init_from (new run "
                             "from existing weights), not both")
        return self

    @model_validator(mode="after")
    def _plateau_needs_evaluations(self):
        if self.plateau_patience and not self.eval_every:
            raise ValueError("train.plateau_patience needs train.eval_every (the held-out "
                             "evaluations it watches)")
        return self

    @model_validator(mode="after")
    def _batch_divisible(self):
        per_step = self.micro_batch_size * self.num_workers
        if self.global_batch_size % per_step:
            raise ValueError(f"global_batch_size {self.global_batch_size} must be a multiple of "
                             f"micro_batch_size x num_workers = {per_step}")
        return self


class CalibrateConfig(Strict):
    max_prompts: int = Field(64, ge=2, description="Held-out prompts decoded for STS (half fit, "
                             "half report).")
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of the rounds "
                               "(acceptance depends on it; use the serving temperature).")
    num_threads: int | None = Field(None, ge=1)
    cpus: float = Field(1.0, gt=0)
    gpus: float = Field(0.0, ge=0)
    dtype: Dtype = "auto"


class EvalConfig(Strict):
    data_dir: str = Field("infra/datasets/eval", description="Benchmark files "
                          "(`<name>.jsonl` or `.jsonl.gz`, `{\"turns\": [...]}` rows); relative "
                          "paths resolve against the project root.")
    datasets: dict[str, int] = Field(
        default_factory=lambda: {"gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164,
                                 "mbpp": 256, "livecodebench": 500, "mt-bench": 80,
                                 "alpaca": 500, "arena-hard-v2": 500},
        description="Benchmark file stem -> number of prompts (SPEC 5 caps by default).")
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0], min_length=1)
    speed_baseline: bool = Field(True, description="Also decode with plain transformers `generate` "
                                 "(what users already have) to measure the speed-up.")
    baseline_dtype: Dtype | None = Field(None, description="dtype of the plain `generate` "
                                         "baseline; None = eval.dtype. auto is the faster one on "
                                         "the machine (bf16 where native, else fp32).")
    max_new_tokens: int = Field(2048, ge=1)
    fixed_gamma_pass: bool = Field(
        True, description="When the engine's scheduler is not `fixed`, also decode every prompt "
        "verifying the drafter's whole gamma-token block each round (no baseline): the drafter's "
        "own tau, the convention of the paper's Table 1 (SPEC 7), which a confidence scheduler's "
        "shorter verified drafts understate. Adds ~half the speculative decoding time.")
    shuffle_seed: int = 980406
    num_threads: int | None = Field(None, ge=1)
    cpus: float = Field(1.0, gt=0)
    gpus: float = Field(0.0, ge=0)
    dtype: Dtype = "auto"

    @field_validator("datasets")
    @classmethod
    def _positive(cls, v):
        bad = [k for k, n in v.items() if n < 1]
        if bad:
            raise ValueError(f"dataset counts must be >= 1: {bad}")
        return v


class WandbConfig(Strict):
    project: str = "dspark-ray"
    entity: str | None = None
    mode: Literal["offline", "online", "disabled"] = "offline"


class PipelineConfig(Strict):
    run_dir: str = Field("runs/default", description="Where every stage writes (relative paths "
                         "resolve against the project root).")
    seed: int = 0
    storage_options: dict[str, Any] = Field(default_factory=dict, description="s3fs options for "
                                            "s3:// paths (endpoint_url, key, secret, ...).")
    ray: RayConfig = Field(default_factory=RayConfig)
    target: TargetConfig
    prompts: PromptsConfig
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="The drafter "
                                   "(drafters/config.py); its type's spec in drafters/registry.py.")
    train: TrainConfig = Field(default_factory=TrainConfig)
    calibrate: CalibrateConfig = Field(default_factory=CalibrateConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Speculative engine "
                                 "of the eval stage (decoding one request at a time; "
                                 "max_num_requests is forced to 1 there).")
    wandb: WandbConfig = Field(default_factory=WandbConfig)


# ----------------------------------------------------------------------------- loading
def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config, apply ``section.field=value`` overrides, validate.

    Raises:
        ConfigError: unreadable file, YAML syntax error, or validation errors (all listed).
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(raw, key, value)
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, str(path))) from None


def dump_config(cfg: PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
