"""The data stages: prompts (validate and split), generate (the target regenerates every
assistant turn), cache (one target forward per sample into the Parquet target cache)."""

from __future__ import annotations

import hashlib
import json
import logging

from tqdm import tqdm

from serve.engine.target_loading import load_target_config, load_tokenizer

from . import storage
from .cache.format import build_manifest, read_manifest
from .cache.stage import run_cache
from .generate.hf import run_generate
from .generate.reuse import (
    check_generation_record,
    generation_record,
    refile_answers,
    reuse_answers,
    write_generation_record,
)
from .prompts import load_prompts, read_ids, read_jsonl, write_jsonl
from .run_layout import CACHE, GENERATE, PROMPTS
from .stage_context import SPLITS, StageContext, ensure_ray
from .target_features import CacheTarget

logger = logging.getLogger(__name__)


def stage_prompts(ctx: StageContext) -> dict:
    cfg = ctx.cfg.prompts
    sources = [(storage.resolve(s.path), s.max_rows) for s in cfg.sources]
    heldout_ids, ids_file = None, "prompts.heldout_ids_from"
    if cfg.heldout_ids_from:
        path = storage.resolve(cfg.heldout_ids_from)
        ids_file = f"prompts.heldout_ids_from ({path})"
        heldout_ids = read_ids(path, ctx.cfg.storage_options)
    split = load_prompts(sources, cfg.heldout_fraction, cfg.seed, ctx.cfg.storage_options,
                         heldout_ids=heldout_ids, heldout_ids_file=ids_file)
    ctx.stage_dir(PROMPTS)
    layout = ctx.layout
    write_jsonl(str(layout.prompts("train")), split.train)
    write_jsonl(str(layout.prompts("heldout")), split.heldout)
    write_jsonl(str(layout.errors(PROMPTS)), split.errors)
    if not split.train:
        raise ValueError(f"no valid training prompts in {sources} (see {layout.errors(PROMPTS)})")
    return {"train": len(split.train), "heldout": len(split.heldout), "errors": len(split.errors)}


def stage_generate(ctx: StageContext) -> dict:
    ensure_ray(ctx.cfg)
    g = ctx.cfg.generate
    out, layout = ctx.stage_dir(GENERATE), ctx.layout
    prompts = {split: read_jsonl(str(layout.prompts(split)))
               for split in SPLITS}
    record = generation_record(ctx.cfg)
    sources = [storage.resolve(p) for p in g.reuse_from or []]
    for source in sources:  # before anything is written: a refused source changes nothing
        check_generation_record(source, record, ctx.cfg.storage_options)
    write_generation_record(out, record)
    refile_answers(out, {split: {r["id"] for r in rows} for split, rows in prompts.items()})
    reused = {}
    if sources:
        for split in SPLITS:
            reused[split] = reuse_answers(prompts[split], layout.generated(split),
                                          layout.errors(GENERATE), sources,
                                          ctx.cfg.storage_options)
    target = dict(target=ctx.target, dtype=ctx.cfg.target.dtype,
                  template_kwargs=ctx.cfg.target.chat_template_kwargs, seed=ctx.cfg.seed)
    splits = {split: (prompts[split], layout.generated(split)) for split in SPLITS}
    if g.backend == "vllm":  # vLLM's own engines, not a Ray Data actor pool
        # lazy: optional: vLLM's backend, only when the config asks for it
        from .generate.vllm_backend import run_generate_vllm as regenerate
    else:
        regenerate = run_generate
    with tqdm(total=sum(len(rows) for rows, _ in splits.values()), desc=f"generate ({g.backend})",
              unit="prompt", mininterval=5) as bar:
        summary = regenerate(splits, layout.errors(GENERATE), g, **target, progress=bar)
    for split, counts in reused.items():
        summary[split].update(counts)
    return summary


def _template_sha(target: str) -> str:
    template = load_tokenizer(target).chat_template or ""
    return hashlib.sha256(template.encode()).hexdigest()


def stage_cache(ctx: StageContext) -> dict:
    mode = ctx.cfg.train.data_mode
    if mode != "offline":  # the train stage computes the features (hybrid: and writes them)
        logger.info("stage cache: nothing to do for train.data_mode %s", mode)
        return {"skipped": f"train.data_mode {mode}"}
    return write_cache(ctx)


def cache_target(ctx: StageContext):
    """The target as the cache stage forwards it (:class:`pipeline.target_features.CacheTarget`)."""
    return CacheTarget(ctx.target, ctx.cfg.target.dtype, ctx.layer_ids,
                       ctx.cfg.target.chat_template_kwargs)


def cache_manifest(ctx: StageContext, splits: dict[str, list[dict]]) -> dict:
    """The manifest of a cache (or of a feature stream) with these splits' shard summaries."""
    tcfg = load_target_config(ctx.target)
    return build_manifest(
        target=ctx.cfg.target.name_or_path, revision=getattr(tcfg, "_commit_hash", None),
        layer_ids=ctx.layer_ids, hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
        template_sha256=_template_sha(ctx.target),
        template_kwargs=ctx.cfg.target.chat_template_kwargs, max_length=ctx.cfg.cache.max_length,
        splits=splits)


def write_cache(ctx: StageContext) -> dict:
    """Write the missing shards of every split, the error file and the manifest (the cache
    stage; hybrid training calls it after its first epoch, when only the held-out split is left).

    Raises:
        ValueError: the cache has no training rows.
    """
    so = ctx.cfg.storage_options
    storage.check_writable(ctx.cache_dir, so)
    if storage.exists(storage.join(ctx.cache_dir, "manifest.json"), so):
        # never overwrite another target's cache shard by shard (cache.output is shared storage)
        ctx.check_cache_target(read_manifest(ctx.cache_dir, so))
    ensure_ray(ctx.cfg)
    c = ctx.cfg.cache
    target = cache_target(ctx)
    ctx.stage_dir(CACHE)
    errors_path = ctx.layout.errors(CACHE)
    # read by Ray Data inside run_cache: the driver never holds the conversations
    generated = {split: ctx.layout.generated(split) for split in SPLITS}
    splits = run_cache({split: str(path) for split, path in generated.items()
                        if path.exists() and path.stat().st_size > 0},
                       ctx.cache_dir, target, c, so)
    splits = {split: shards for split, shards in splits.items() if shards}
    errors = [e for shards in splits.values() for s in shards for e in s["errors"]]
    with open(errors_path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in errors)
    manifest = cache_manifest(ctx, splits)
    if "train" not in splits or manifest["splits"]["train"]["rows"] == 0:
        raise ValueError(f"the cache has no training rows (see {errors_path})")
    storage.write_bytes_atomic(storage.join(ctx.cache_dir, "manifest.json"),
                               json.dumps(manifest, indent=1).encode(), so)
    return {"cache_dir": ctx.cache_dir, "errors": len(errors),
            **{f"{s}_rows": v["rows"] for s, v in manifest["splits"].items()},
            **{f"{s}_tokens": v["tokens"] for s, v in manifest["splits"].items()}}
