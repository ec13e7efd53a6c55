"""The pipeline's stages, listed once in order (:data:`STAGES`), and how a stage is run: its
completion marker, its config fingerprint, clearing it (``--force``), repairing the cache, and the
checks before any stage runs.

Each stage reads the previous stage's output under the run directory and writes its own; a stage
whose ``_SUCCESS.json`` exists is skipped. Stages that are interrupted resume: generation by prompt
id, the cache by shard. A new stage is one function (``data_stages.py`` or ``model_stages.py``)
and one :class:`Stage` in :data:`STAGES`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from typing import Callable

from . import storage
from .cache.format import CorruptShardError, read_manifest, verify_shard
from .config import (
    DEFAULT_FORWARD_BATCH_TOKENS,
    DEFAULT_ROW_GROUP_BYTES,
    PipelineConfig,
    VllmGenerateConfig,
)
from .data_stages import stage_cache, stage_generate, stage_prompts
from .model_stages import stage_calibrate, stage_eval, stage_train
from .run_layout import CACHE, CALIBRATE, EVAL, GENERATE, PROMPTS, STAGE_ORDER, TRAIN
from .stage_checks import check_cache, check_eval, check_generate, check_prompts, check_train
from .stage_context import SPLITS, StageContext, ensure_ray

__all__ = ["STAGES", "STAGE_NAMES", "SPLITS", "Stage", "StageContext", "ensure_ray", "stage",
           "stage_fingerprint", "clear_stage", "repair_cache", "run_stage", "preflight"]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage."""

    name: str  # its --stages name and its directory under the run directory
    config: tuple[str, ...]  # config sections its output depends on (with every earlier stage's)
    reads: str | None  # the stage whose output it reads (it must have completed), or None
    writes: str  # what it writes, under the run directory unless said otherwise
    run: Callable[[StageContext], dict]  # does the work; returns the summary for its marker
    # what it will read, checked before any stage of the run starts (pipeline/stage_checks.py):
    # (context, will it run, is it forced) -> None, or raises naming the input
    check: Callable[[StageContext, bool, bool], None] | None = None


# the stage names are pipeline/run_layout.py's (where each stage's outputs live, RunLayout)
STAGES: tuple[Stage, ...] = (
    Stage(PROMPTS, ("prompts", "storage_options"), None,
          "prompts/{train,heldout,errors}.jsonl", stage_prompts, check_prompts),
    Stage(GENERATE, ("target", "generate", "seed"), PROMPTS,
          "generate/{train,heldout,errors}.jsonl", stage_generate, check_generate),
    Stage(CACHE, ("cache",), GENERATE,
          "the target cache at cache.output (default cache/): shards + manifest.json; "
          "cache/errors.jsonl", stage_cache, check_cache),
    Stage(TRAIN, ("drafter", "train"), CACHE,
          "train/drafter, train/ray_train checkpoints, train/wandb", stage_train, check_train),
    Stage(CALIBRATE, ("calibrate",), TRAIN,
          "calibrate/drafter (with STS temperatures), calibrate/report.json", stage_calibrate),
    Stage(EVAL, ("eval", "engine"), CALIBRATE,
          "eval/report.{json,md}, plots, eval/engine_files", stage_eval, check_eval),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
assert STAGE_NAMES == STAGE_ORDER, "STAGES must list run_layout.STAGE_ORDER in order"


def stage(name: str) -> Stage:
    """The stage called ``name``.

    Raises:
        KeyError: no such stage (the known names listed).
    """
    for s in STAGES:
        if s.name == name:
            return s
    raise KeyError(f"unknown stage {name!r}; choose from {list(STAGE_NAMES)}")


# config fields added after run directories existed: at their defaults they leave a stage's
# fingerprint as it was, so runs made before them still count as complete. Why a list kept by hand
# and not "every field at its default is left out": a default can change meaning later (a new
# default for an old field), and a run made under the old one must then stop as changed, not
# pass as complete; the list names exactly the fields whose default is the old behaviour
ADDED_LATER = [("drafter", "qk_norm", None), ("engine", "kv_cache_memory_gib", 2.0),
               ("generate", "backend", "hf"), ("generate", "max_num_requests", 128),
               ("generate", "kv_cache_memory_gib", 4.0),
               ("generate", "vllm", VllmGenerateConfig().model_dump(mode="json")),
               ("cache", "forward_batch_tokens", DEFAULT_FORWARD_BATCH_TOKENS),
               ("train", "placement_strategy", "PACK"),
               ("cache", "row_group_bytes", DEFAULT_ROW_GROUP_BYTES),
               ("train", "max_train_rows", None), ("train", "plateau_patience", None),
               ("train", "plateau_min_delta", 0.01),
               ("engine", "seeded_sampling", "load_invariant"),
               ("engine", "min_tokens_per_s", None), ("train", "data_mode", "offline"),
               ("train", "stream_object_store_gib", 2.0), ("train", "stream_shuffle_rows", 64),
               ("eval", "fixed_gamma_pass", True),
               # no value reproduces the ungated probes exactly (1.0 is closest), but the eval
               # stage decodes one request at a time, where the gate lets due probes through
               ("engine", "probe_alpha", 0.8), ("prompts", "heldout_ids_from", None),
               # the kernel attends as the PyTorch path did, up to rounding
               ("engine", "attention", "kernel"), ("train", "objective", None),
               # 'target' is full attention on full-attention targets, so such runs stay
               # complete. A run on a sliding-window target (Mistral, Phi-3, Qwen2 with
               # use_sliding_window, Gemma 3 / gpt-oss whose mirrored layers slide) made before
               # trained a full-attention drafter and stays complete too: its checkpoint says so
               # (no layer_windows) and loads as such; re-run with --force train for a windowed one
               ("drafter", "sliding_window", "target"),
               # filling passes changes only speed (lossless), and only on jagged profiles
               ("engine", "fill_passes", True),
               # the plain anchor is what every run before the first-slot variant trained
               ("drafter", "anchor_features", False)]
# config fields that say where a stage may take its outputs from, not what they are: never
# fingerprinted, so adding the shipped answers to a run that regenerated them changes nothing
NOT_FINGERPRINTED = [("generate", "reuse_from")]
# config fields renamed after run directories existed: fingerprinted under their old names, so
# runs made before the rename still count as complete
RENAMED = [("engine", "num_speculative_tokens", "num_draft_tokens")]


def stage_fingerprint(cfg: PipelineConfig, name: str) -> str:
    """sha256 of the config sections stage ``name`` and every earlier stage depend on."""
    upto = STAGE_NAMES.index(name) + 1
    sections = [section for s in STAGES[:upto] for section in s.config]
    dumped = cfg.model_dump(mode="json")
    for section, key, default in ADDED_LATER:  # at their defaults, as if absent
        if dumped.get(section, {}).get(key, object()) == default:
            del dumped[section][key]
    for section, key in NOT_FINGERPRINTED:
        dumped.get(section, {}).pop(key, None)
    for section, key, old in RENAMED:
        if key in dumped.get(section, {}):
            dumped[section][old] = dumped[section].pop(key)
    return hashlib.sha256(json.dumps({s: dumped[s] for s in sections},
                                     sort_keys=True).encode()).hexdigest()


def clear_stage(ctx: StageContext, name: str) -> None:
    """Remove a stage's outputs and the completion markers of it and every later stage."""
    for later in STAGE_NAMES[STAGE_NAMES.index(name):]:
        ctx.marker(later).unlink(missing_ok=True)
    stage_dir = ctx.layout.stage_dir(name)
    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    if name == CACHE:
        fs = storage.get_fsspec(ctx.cache_dir, ctx.cfg.storage_options)
        if fs.exists(ctx.cache_dir):
            fs.rm(ctx.cache_dir, recursive=True)


def repair_cache(ctx: StageContext) -> list[str]:
    """Check every shard of the cache manifest against its sha256, row count and schema; delete
    each damaged shard with its sidecar and reopen the cache stage and the stages after it (their
    markers go, their outputs stay), so the next cache stage rewrites only those shards.

    Returns:
        the damaged shards' paths (empty: nothing changed).
    Raises:
        FileNotFoundError: the cache has no manifest (run the cache stage instead).
    """
    so = ctx.cfg.storage_options
    manifest = read_manifest(ctx.cache_dir, so)
    damaged = []
    for split, info in manifest["splits"].items():
        for shard in info.get("shards", []):
            try:
                verify_shard(ctx.cache_dir, split, shard, so)
            except (CorruptShardError, FileNotFoundError) as err:
                logger.warning("repair: %s", err)
                damaged.append(storage.join(ctx.cache_dir, split, shard["file"]))
    if not damaged:
        return []
    fs = storage.get_fsspec(ctx.cache_dir, so)
    for path in damaged:
        for name in (path, path[:-len(".parquet")] + ".json"):
            if fs.exists(name):
                fs.rm(name)
    for later in STAGE_NAMES[STAGE_NAMES.index(CACHE):]:
        ctx.marker(later).unlink(missing_ok=True)
    return damaged


def run_stage(ctx: StageContext, name: str, force: bool = False) -> dict:
    """Run one stage unless complete; write its marker with a summary.

    Raises:
        ValueError: the stage completed under a different config (the message says how to redo it).
    """
    this = stage(name)
    marker = ctx.marker(name)
    fingerprint = stage_fingerprint(ctx.cfg, name)
    if force:
        clear_stage(ctx, name)
    if marker.exists():
        done = json.loads(marker.read_text())
        if done.get("config_fingerprint") != fingerprint:
            raise ValueError(
                f"stage {name!r} in {ctx.run_dir} completed under a different config (sections "
                f"{list(this.config)} or earlier ones changed); pass --force {name} to redo it "
                "and the stages after it, or use another run_dir")
        logger.info("stage %s: complete, skipped (%s)", name, marker)
        return done
    if this.reads:
        ctx.require(this.reads)
    start = time.time()
    logger.info("stage %s: starting", name)
    summary = this.run(ctx)
    summary["config_fingerprint"] = fingerprint
    summary["seconds"] = round(time.time() - start, 1)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(summary, indent=1))
    logger.info("stage %s: done in %.1f s: %s", name, summary["seconds"],
                json.dumps({k: v for k, v in summary.items()
                            if not isinstance(v, (dict, list)) and k != "config_fingerprint"}))
    return summary


def preflight(ctx: StageContext, ordered: list[str], forced: list[str]) -> None:
    """Check what the stages in ``ordered`` will read, before any of them runs (or is cleared by
    ``--force``): each stage's own check (``Stage.check``, ``pipeline/stage_checks.py``), told
    whether the stage will run (not complete, or forced) and whether it is forced.

    Raises:
        VllmNotInstalledError, EvalDataError, FileNotFoundError, ValueError (a directory where
        a file is wanted), DrafterCheckpointError, CacheMismatchError, LayerInitError.
    """
    for name in ordered:
        this = stage(name)
        if this.check is not None:
            is_forced = name in forced
            this.check(ctx, is_forced or not ctx.marker(name).exists(), is_forced)
