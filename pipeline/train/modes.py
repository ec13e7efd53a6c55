"""The train stage without a finished cache (``train.data_mode``, :mod:`pipeline.feature_stream`):

- *online*: one Ray Train run whose workers read the Ray Data feature stream (every epoch
  recomputed by the target actors, nothing stored).
- *hybrid*: the first epoch streams the cache stage's own shards as they are written (a shard
  already written is read back, never recomputed), training stops at the epoch's end with a
  checkpoint; the cache is then finished (held-out split, manifest, error file: the cache stage's
  :func:`pipeline.data_stages.write_cache`) and training continues from that checkpoint reading
  the cache, with the same LR schedule. An interrupted hybrid run resumes in whichever phase it
  stopped.
"""

from __future__ import annotations

import json
import logging

from .. import storage
from ..cache.format import read_manifest
from ..cache.shards import pack_shards
from ..data_stages import cache_manifest, cache_target, write_cache
from ..feature_stream import (
    HeldoutStream,
    HybridStream,
    TrainStream,
    put_conversations,
    scan_split,
)
from ..run_layout import TRAIN
from ..stage_context import SPLITS, StageContext, ensure_ray
from .data import steps_per_epoch
from .driver import run_train

logger = logging.getLogger(__name__)


def generated_files(ctx: StageContext) -> dict[str, str]:
    """{split: generate output path} of the non-empty splits."""
    out = {}
    for split in SPLITS:
        path = ctx.layout.generated(split)
        if path.exists() and path.stat().st_size:
            out[split] = str(path)
    return out


def stream_manifest(ctx: StageContext, scans: dict) -> dict:
    """A manifest for streamed training: the statistics a cache of these conversations would
    have (rows, tokens, supervised-token frequencies for the draft vocabulary) and no shards."""
    manifest = cache_manifest(ctx, {split: [scan.summary] for split, scan in scans.items()})
    for info in manifest["splits"].values():
        info["shards"] = []
    manifest["data_mode"] = "stream"
    return manifest


def _scan(ctx: StageContext, files: dict[str, str]) -> dict:
    """:func:`pipeline.feature_stream.scan_split` of every split; errors to train/stream_errors."""
    scans = {split: scan_split(path, cache_target(ctx), ctx.cfg.cache)
             for split, path in files.items()}
    errors = [e for scan in scans.values() for e in scan.errors]
    ctx.stage_dir(TRAIN)
    with open(ctx.layout.stream_errors, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in errors)
    if "train" not in scans or scans["train"].rows == 0:
        raise ValueError(f"no training samples in {files.get('train')} (see "
                         f"{ctx.layout.stream_errors})")
    return scans


def _heldout(ctx: StageContext, files: dict[str, str], scans: dict):
    """The held-out rows (a materialized dataset), or None when not evaluating."""
    if not ctx.cfg.train.eval_every or "heldout" not in scans or not scans["heldout"].rows:
        return None
    # computed once, now: a few rows, and no target actors beside the trainers later
    return HeldoutStream(put_conversations(files["heldout"], ctx.cfg.storage_options),
                         scans["heldout"].samples_per_conversation, cache_target(ctx),
                         ctx.cfg.cache, ctx.cfg.train.eval_rows)().materialize()


def _run(ctx: StageContext, manifest: dict, train=None, **kwargs) -> dict:
    return run_train(
        cache_dir=ctx.cache_dir, manifest=manifest, out_dir=ctx.stage_dir(TRAIN),
        target=ctx.target, layer_ids=ctx.layer_ids, drafter=ctx.cfg.drafter,
        train=train or ctx.cfg.train, wandb_cfg=ctx.cfg.wandb.model_dump(),
        storage_options=ctx.cfg.storage_options, run_name=ctx.run_dir.name, **kwargs)


def check_resources(ctx: StageContext) -> None:
    """The trainers and the target actors must fit the cluster together: Ray Data waits for
    actors it cannot place without a word, so a config that over-asks would hang.

    Raises:
        ValueError: naming the fields and what they ask against what the cluster has.
    """
    import ray

    tc, c = ctx.cfg.train, ctx.cfg.cache
    have = ray.cluster_resources()
    # one CPU more for Ray Data's small tasks (the stream's positions, reading the output)
    cpus = tc.num_workers * tc.cpus_per_worker + c.num_actors * c.cpus_per_actor + 1
    gpus = tc.num_workers * int(tc.use_gpu) + c.num_actors * c.gpus_per_actor
    if cpus > have.get("CPU", 0) or gpus > have.get("GPU", 0):
        raise ValueError(
            f"train.data_mode {tc.data_mode} runs the trainers and the target actors together: "
            f"train.num_workers x train.cpus_per_worker + cache.num_actors x "
            f"cache.cpus_per_actor + 1 = {cpus:g} CPUs and {gpus:g} GPUs, the Ray cluster has "
            f"{have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs; lower them (or raise "
            "ray.num_cpus on a single machine)")


def train_online(ctx: StageContext) -> dict:
    """``train.data_mode: online``: returns the :func:`pipeline.train.driver.run_train` result."""
    ensure_ray(ctx.cfg)
    check_resources(ctx)
    files = generated_files(ctx)
    scans = _scan(ctx, files)
    manifest = stream_manifest(ctx, scans)
    tc = ctx.cfg.train
    conversations = put_conversations(files["train"], ctx.cfg.storage_options)
    heldout = _heldout(ctx, files, scans)
    logger.info("online training: %d samples per epoch (%d steps), features streamed from %d "
                "target actor(s)", scans["train"].rows,
                steps_per_epoch(scans["train"].rows, tc.global_batch_size), ctx.cfg.cache.num_actors)

    def streams(checkpoints, total_steps: int) -> dict:
        train = TrainStream(conversations, scans["train"], cache_target(ctx), ctx.cfg.cache,
                            tc.seed, total_steps, tc.global_batch_size, checkpoints)
        return {"train": train, **({"heldout": heldout} if heldout else {})}

    return _run(ctx, manifest, streams=streams)


def train_hybrid(ctx: StageContext) -> dict:
    """``train.data_mode: hybrid`` without a finished cache: the first epoch streams (and writes)
    the cache, the rest reads it. Returns the last phase's :func:`pipeline.train.driver.run_train`
    result with ``phases`` (steps of each)."""
    ensure_ray(ctx.cfg)
    check_resources(ctx)
    files = generated_files(ctx)
    scans = _scan(ctx, files)
    tc, so, c = ctx.cfg.train, ctx.cfg.storage_options, ctx.cfg.cache
    per_epoch = steps_per_epoch(scans["train"].rows, tc.global_batch_size)
    storage.check_writable(ctx.cache_dir, so)
    packed, _ = pack_shards({"train": files["train"]}, ctx.cache_dir, cache_target(ctx), c)
    heldout = _heldout(ctx, files, scans)

    def streams(checkpoints, total_steps: int) -> dict:
        train = HybridStream(packed, scans["train"].rows, cache_target(ctx), c, tc.seed,
                             checkpoints)
        return {"train": train, **({"heldout": heldout} if heldout else {})}

    first = _run(ctx, stream_manifest(ctx, scans), streams=streams, stop_step=per_epoch)
    phases = {"streamed_steps": first["steps"]}
    if first["steps"] < per_epoch:  # the plateau or max_steps came first: no later epoch
        logger.info("hybrid: training ended in its first epoch (step %d); the cache is not "
                    "finished (run the cache stage to finish it)", first["steps"])
        return {**first, "phases": phases}
    logger.info("hybrid: first epoch streamed and cached; finishing the cache")
    cache_summary = write_cache(ctx)
    rest = _run(ctx, read_manifest(ctx.cache_dir, so),
                train=tc.model_copy(update={"resume_from": "latest", "verify_cache": False}))
    phases["cached_steps"] = rest["steps"] - first["steps"]
    phases["cache"] = {k: v for k, v in cache_summary.items() if not isinstance(v, dict)}
    return {**rest, "phases": phases}
