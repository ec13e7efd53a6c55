"""The five pipeline stages and their glue: inputs, outputs, completion markers, Ray start-up.

Each stage reads the previous stage's output under the run directory and writes its own; a stage
whose ``_SUCCESS.json`` exists is skipped. Stages that are interrupted resume: generation by prompt
id, the cache by shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import ray_logs, storage
from .config import (DEFAULT_FORWARD_BATCH_TOKENS, DEFAULT_ROW_GROUP_BYTES, PipelineConfig,
                     VllmGenerateConfig, dump_config)

logger = logging.getLogger(__name__)
SPLITS = ("train", "heldout")


@dataclass
class StageContext:
    """Resolved paths and target facts shared by the stages."""

    cfg: PipelineConfig
    run_dir: Path
    target: str
    layer_ids: list[int]
    cache_dir: str

    @classmethod
    def create(cls, cfg: PipelineConfig) -> "StageContext":
        """Resolve paths, materialise a packaged target if needed, pick the target layers.

        Raises:
            FileNotFoundError: the target cannot be found or loaded (path named).
        """
        from transformers import AutoConfig

        from serve.target_loading import default_layer_ids, materialize_gguf_target

        run_dir = Path(storage.resolve(cfg.run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        target = cfg.target.name_or_path
        if cfg.target.convert_from_gguf is not None:
            src = cfg.target.convert_from_gguf
            target = str(materialize_gguf_target(storage.resolve(target), src.package, src.file))
        elif not storage.is_url(target) and (target.startswith((".", "/", "~"))):
            target = storage.resolve(target)
        try:
            tcfg = AutoConfig.from_pretrained(target)
        except (OSError, ValueError) as err:
            raise FileNotFoundError(f"unknown target model {target!r}: {err}") from err
        layer_ids = cfg.target.layer_ids or default_layer_ids(tcfg.num_hidden_layers,
                                                              cfg.target.num_context_layers)
        if max(layer_ids) >= tcfg.num_hidden_layers:
            raise ValueError(f"target.layer_ids {layer_ids} exceed the target's "
                             f"{tcfg.num_hidden_layers} layers")
        cache_dir = storage.resolve(cfg.cache.output) if cfg.cache.output else str(run_dir / "cache")
        return cls(cfg, run_dir, target, layer_ids, cache_dir)

    def drafter_location(self, stage: str) -> str:
        """Where the later stages read ``stage``'s drafter ("train" or "calibrate"): with
        ``train.storage_path`` set (shared storage, e.g. s3:// on a multi-node cluster) the copy
        published there (``<storage_path>/<run name>/published/<stage>``), since Ray may run
        calibration and evaluation on a node that cannot see the driver's disk; else the run
        directory's ``<stage>/drafter``."""
        if self.cfg.train.storage_path:
            return storage.join(storage.resolve(self.cfg.train.storage_path), self.run_dir.name,
                                "published", stage)
        return str(self.run_dir / stage / "drafter")

    def publish_drafter(self, stage: str) -> str:
        """Copy ``<run_dir>/<stage>/drafter`` to :meth:`drafter_location` when that is shared
        storage; returns the location."""
        where = self.drafter_location(stage)
        if self.cfg.train.storage_path:
            storage.upload_dir(self.run_dir / stage / "drafter", where, self.cfg.storage_options)
            logger.info("%s drafter published to %s", stage, where)
        return where

    def stage_dir(self, name: str) -> Path:
        path = self.run_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


_ray_started = False


def ensure_ray(cfg: PipelineConfig) -> None:
    """Join the cluster named by ``ray.address`` / ``RAY_ADDRESS`` (as inside ``ray job submit``),
    or start a local Ray in-process."""
    global _ray_started
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # Ray Data needs CPU slots to read the cache while every trainer holds one: a local Ray
        # gets two logical CPUs more than the machine has unless the config says otherwise
        num_cpus = cfg.ray.num_cpus or (os.cpu_count() or 1) + 2
        try:
            # no dashboard (~1 GB in ten processes); the runtime env's worker hook drops the
            # warning Ray Train's placement-group cleaner logs every second without one
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                     runtime_env=ray_logs.LOCAL_RUNTIME_ENV)
        except ValueError as err:  # a `ray start` cluster runs here: join it as it is
            if "existing cluster" not in str(err):
                raise
            logger.info("joining the Ray cluster already running on this machine")
            ray.init(log_to_driver=True)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # stages print their own progress
    # the memory-issue detector warns every 30 s about model-holding actors; the stages size
    # their actors explicitly, so the warning is noise here
    ctx.issue_detectors_config.detectors = []
    # a generate or cache batch may legitimately run longer than Ray Data's 30-minute
    # no-progress limit (1,024 answers of 512 tokens on two cores took > 30 min and the stage
    # was failed with ExecutionTimeoutError); the stages' own retries and resume handle failures
    if "RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S" not in os.environ:
        ctx.execution_no_progress_timeout_s = -1
    _ray_started = True


def _marker(ctx: StageContext, name: str) -> Path:
    return ctx.run_dir / name / "_SUCCESS.json"


# config sections each stage's output depends on, cumulatively: a change upstream invalidates
# every later stage
STAGE_INPUTS = {"prompts": ["prompts", "storage_options"],
                "generate": ["target", "generate", "seed"],
                "cache": ["cache"],
                "train": ["drafter", "train"],
                "calibrate": ["calibrate"],
                "eval": ["eval", "engine"]}


# config fields added after run directories existed: at their defaults they leave a stage's
# fingerprint as it was, so runs made before them still count as complete
ADDED_LATER = [("drafter", "qk_norm", None), ("engine", "kv_cache_memory_gib", 2.0),
               ("generate", "backend", "hf"), ("generate", "max_num_requests", 128),
               ("generate", "kv_cache_memory_gib", 4.0),
               ("generate", "vllm", VllmGenerateConfig().model_dump(mode="json")),
               ("cache", "forward_batch_tokens", DEFAULT_FORWARD_BATCH_TOKENS),
               ("train", "placement_strategy", "PACK"),
               ("cache", "row_group_bytes", DEFAULT_ROW_GROUP_BYTES),
               ("train", "max_train_rows", None), ("train", "plateau_patience", None),
               ("train", "plateau_min_delta", 0.01)]
# config fields renamed after run directories existed: fingerprinted under their old names, so
# runs made before the rename still count as complete
RENAMED = [("engine", "num_speculative_tokens", "num_draft_tokens")]


def stage_fingerprint(cfg: PipelineConfig, name: str) -> str:
    from .config import STAGES

    sections = [s for stage in STAGES[:STAGES.index(name) + 1] for s in STAGE_INPUTS[stage]]
    dumped = cfg.model_dump(mode="json")
    for section, key, default in ADDED_LATER:  # at their defaults, as if absent
        if dumped.get(section, {}).get(key, object()) == default:
            del dumped[section][key]
    for section, key, old in RENAMED:
        if key in dumped.get(section, {}):
            dumped[section][old] = dumped[section].pop(key)
    return hashlib.sha256(json.dumps({s: dumped[s] for s in sections},
                                     sort_keys=True).encode()).hexdigest()


def clear_stage(ctx: StageContext, name: str) -> None:
    """Remove a stage's outputs and the completion markers of it and every later stage."""
    import shutil

    from .config import STAGES

    for later in STAGES[STAGES.index(name):]:
        _marker(ctx, later).unlink(missing_ok=True)
    stage_dir = ctx.run_dir / name
    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    if name == "cache":
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
    from .cache import CorruptShardError, read_manifest, verify_shard
    from .config import STAGES

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
    for later in STAGES[STAGES.index("cache"):]:
        _marker(ctx, later).unlink(missing_ok=True)
    return damaged


def run_stage(ctx: StageContext, name: str, force: bool = False) -> dict:
    """Run one stage unless complete; write its marker with a summary.

    Raises:
        ValueError: the stage completed under a different config (the message says how to redo it).
    """
    marker = _marker(ctx, name)
    fingerprint = stage_fingerprint(ctx.cfg, name)
    if force:
        clear_stage(ctx, name)
    if marker.exists():
        done = json.loads(marker.read_text())
        if done.get("config_fingerprint") != fingerprint:
            raise ValueError(
                f"stage {name!r} in {ctx.run_dir} completed under a different config (sections "
                f"{STAGE_INPUTS[name]} or earlier ones changed); pass --force {name} to redo it "
                "and the stages after it, or use another run_dir")
        logger.info("stage %s: complete, skipped (%s)", name, marker)
        return done
    start = time.time()
    logger.info("stage %s: starting", name)
    summary = STAGE_FUNCS[name](ctx)
    summary["config_fingerprint"] = fingerprint
    summary["seconds"] = round(time.time() - start, 1)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(summary, indent=1))
    logger.info("stage %s: done in %.1f s: %s", name, summary["seconds"],
                json.dumps({k: v for k, v in summary.items()
                            if not isinstance(v, (dict, list)) and k != "config_fingerprint"}))
    return summary


def _require(ctx: StageContext, name: str) -> None:
    if not _marker(ctx, name).exists():
        raise FileNotFoundError(f"stage {name!r} has not completed in {ctx.run_dir}; run it first "
                                f"(--stages {name},...)")


# ----------------------------------------------------------------------------- stages
def stage_prompts(ctx: StageContext) -> dict:
    from .prompts import load_prompts, write_jsonl

    cfg = ctx.cfg.prompts
    sources = [(storage.resolve(s.path), s.max_rows) for s in cfg.sources]
    split = load_prompts(sources, cfg.heldout_fraction, cfg.seed, ctx.cfg.storage_options)
    out = ctx.stage_dir("prompts")
    write_jsonl(str(out / "train.jsonl"), split.train)
    write_jsonl(str(out / "heldout.jsonl"), split.heldout)
    write_jsonl(str(out / "errors.jsonl"), split.errors)
    if not split.train:
        raise ValueError(f"no valid training prompts in {sources} (see {out / 'errors.jsonl'})")
    return {"train": len(split.train), "heldout": len(split.heldout), "errors": len(split.errors)}


def stage_generate(ctx: StageContext) -> dict:
    from tqdm import tqdm

    from .generate import run_generate
    from .prompts import read_jsonl

    _require(ctx, "prompts")
    ensure_ray(ctx.cfg)
    g = ctx.cfg.generate
    out = ctx.stage_dir("generate")
    if g.backend == "vllm":
        from .generate_vllm import run_generate_vllm

        splits = {split: (read_jsonl(str(ctx.run_dir / "prompts" / f"{split}.jsonl")),
                          out / f"{split}.jsonl") for split in SPLITS}
        with tqdm(total=sum(len(rows) for rows, _ in splits.values()), desc="generate (vllm)",
                  unit="prompt", mininterval=5) as bar:
            return run_generate_vllm(
                splits, out / "errors.jsonl", target=ctx.target, dtype=ctx.cfg.target.dtype,
                sampling=g.sampling.model_dump(),
                template_kwargs=ctx.cfg.target.chat_template_kwargs,
                max_prompt_tokens=g.max_prompt_tokens, seed=ctx.cfg.seed, vllm=g.vllm,
                progress=bar)
    udf, udf_kwargs = None, None
    if g.backend == "engine":
        from .generate_engine import EngineGenerateUDF

        udf = EngineGenerateUDF
        udf_kwargs = {"max_num_requests": g.max_num_requests,
                      "kv_cache_memory_gib": g.kv_cache_memory_gib}
    summary = {}
    for split in SPLITS:
        rows = read_jsonl(str(ctx.run_dir / "prompts" / f"{split}.jsonl"))
        with tqdm(total=len(rows), desc=f"generate {split}", unit="prompt", mininterval=5) as bar:
            counts = run_generate(
                rows, out / f"{split}.jsonl", out / "errors.jsonl", target=ctx.target,
                dtype=ctx.cfg.target.dtype, sampling=g.sampling.model_dump(),
                template_kwargs=ctx.cfg.target.chat_template_kwargs, batch_size=g.batch_size,
                num_actors=g.num_actors, cpus_per_actor=g.cpus_per_actor,
                gpus_per_actor=g.gpus_per_actor, num_threads=g.num_threads,
                max_prompt_tokens=g.max_prompt_tokens, seed=ctx.cfg.seed, progress=bar,
                udf=udf, udf_kwargs=udf_kwargs)
        summary[split] = counts
    return summary


def _template_sha(target: str) -> str:
    from serve.target_loading import load_tokenizer

    template = load_tokenizer(target).chat_template or ""
    return hashlib.sha256(template.encode()).hexdigest()


def stage_cache(ctx: StageContext) -> dict:
    from transformers import AutoConfig

    from .cache import build_manifest, read_manifest, run_cache_split

    _require(ctx, "generate")
    so = ctx.cfg.storage_options
    storage.check_writable(ctx.cache_dir, so)
    if storage.exists(storage.join(ctx.cache_dir, "manifest.json"), so):
        # never overwrite another target's cache shard by shard (cache.output is shared storage)
        _check_cache_target(ctx, read_manifest(ctx.cache_dir, so))
    ensure_ray(ctx.cfg)
    c = ctx.cfg.cache
    splits = {}
    errors_path = ctx.stage_dir("cache") / "errors.jsonl"
    for split in SPLITS:
        # read by Ray Data inside run_cache_split: the driver never holds the conversations
        generated = ctx.run_dir / "generate" / f"{split}.jsonl"
        if not generated.exists() or generated.stat().st_size == 0:
            continue
        shards = run_cache_split(
            str(generated), storage.join(ctx.cache_dir, split), target=ctx.target,
            dtype=ctx.cfg.target.dtype, layer_ids=ctx.layer_ids,
            template_kwargs=ctx.cfg.target.chat_template_kwargs, max_length=c.max_length,
            min_supervised=c.min_supervised_tokens, rows_per_shard=c.rows_per_shard,
            rows_per_row_group=c.rows_per_row_group, num_actors=c.num_actors,
            cpus_per_actor=c.cpus_per_actor, gpus_per_actor=c.gpus_per_actor,
            num_threads=c.num_threads, storage_options=so,
            forward_batch_tokens=c.forward_batch_tokens, row_group_bytes=c.row_group_bytes)
        if shards:
            splits[split] = shards
    errors = [e for shards in splits.values() for s in shards for e in s["errors"]]
    with open(errors_path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in errors)
    tcfg = AutoConfig.from_pretrained(ctx.target)
    manifest = build_manifest(
        target=ctx.cfg.target.name_or_path, revision=getattr(tcfg, "_commit_hash", None),
        layer_ids=ctx.layer_ids, hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
        template_sha256=_template_sha(ctx.target),
        template_kwargs=ctx.cfg.target.chat_template_kwargs, max_length=c.max_length,
        splits=splits)
    if "train" not in splits or manifest["splits"]["train"]["rows"] == 0:
        raise ValueError(f"the cache has no training rows (see {errors_path})")
    storage.write_bytes_atomic(storage.join(ctx.cache_dir, "manifest.json"),
                               json.dumps(manifest, indent=1).encode(), so)
    return {"cache_dir": ctx.cache_dir, "errors": len(errors),
            **{f"{s}_rows": v["rows"] for s, v in manifest["splits"].items()},
            **{f"{s}_tokens": v["tokens"] for s, v in manifest["splits"].items()}}


def _check_cache_target(ctx: StageContext, manifest: dict) -> None:
    """Raise CacheMismatchError when the cache at ``ctx.cache_dir`` belongs to another target."""
    from transformers import AutoConfig

    from .cache import check_cache_matches

    tcfg = AutoConfig.from_pretrained(ctx.target)
    check_cache_matches(manifest, ctx.cache_dir, target=ctx.cfg.target.name_or_path,
                        hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                        layer_ids=ctx.layer_ids)


def stage_train(ctx: StageContext) -> dict:
    from .cache import read_manifest
    from .train import run_train
    from .train_data import subset_manifest

    _require(ctx, "cache")
    manifest = read_manifest(ctx.cache_dir, ctx.cfg.storage_options)
    _check_cache_target(ctx, manifest)
    manifest = subset_manifest(manifest, ctx.cfg.train.max_train_rows, ctx.cfg.seed)
    ensure_ray(ctx.cfg)
    result = run_train(
        cache_dir=ctx.cache_dir, manifest=manifest, out_dir=ctx.stage_dir("train"),
        target=ctx.target, layer_ids=ctx.layer_ids, drafter=ctx.cfg.drafter,
        train=ctx.cfg.train, wandb_cfg=ctx.cfg.wandb.model_dump(),
        storage_options=ctx.cfg.storage_options, run_name=ctx.run_dir.name)
    return {"steps": result["steps"], "rows": result["rows"],
            "drafter": str(ctx.run_dir / "train" / "drafter"),
            "published": ctx.publish_drafter("train"), "draft_vocab": result["draft_vocab"],
            "final_metrics": {k: v for k, v in result["metrics"].items()
                              if isinstance(v, (int, float))}}


def _heldout_prompts(ctx: StageContext, limit: int) -> list[str]:
    """First user turns of the held-out conversations (falls back to training prompts with a
    warning when the split is empty, e.g. heldout_fraction 0)."""
    from .prompts import read_jsonl

    rows = read_jsonl(str(ctx.run_dir / "prompts" / "heldout.jsonl"))
    if not rows:
        logger.warning("no held-out prompts: calibrating on training prompts instead")
        rows = read_jsonl(str(ctx.run_dir / "prompts" / "train.jsonl"))
    return [r["messages"][0]["content"] for r in rows[:limit]]


def stage_calibrate(ctx: StageContext) -> dict:
    import ray

    from .tracking import log_calibration, log_drafter_artifact, open_run

    from .calibrate import collect_rounds, fit_and_report

    _require(ctx, "train")
    c = ctx.cfg.calibrate
    ensure_ray(ctx.cfg)
    task = ray.remote(num_cpus=c.cpus, num_gpus=c.gpus or None)(collect_rounds)
    drafter_dir = ctx.drafter_location("train")
    so = ctx.cfg.storage_options
    collected = ray.get(task.remote(
        target=ctx.target, dtype=c.dtype, drafter_dir=drafter_dir,
        template_kwargs=ctx.cfg.target.chat_template_kwargs,
        prompts=_heldout_prompts(ctx, c.max_prompts), temperature=c.temperature,
        max_new_tokens=c.max_new_tokens, seed=ctx.cfg.seed, num_threads=c.num_threads,
        storage_options=so))
    out = ctx.stage_dir("calibrate")
    summary = fit_and_report(collected, out, storage.local_copy(drafter_dir, so), ctx.cfg.seed)
    summary["published"] = ctx.publish_drafter("calibrate")
    run = open_run(ctx.cfg.wandb.model_dump(), ctx.run_dir, ctx.run_dir.name, "calibrate")
    if run is not None:
        log_calibration(run, summary.get("report") or {}, out)
        log_drafter_artifact(run, out / "drafter", f"drafter-calibrated-{ctx.run_dir.name}",
                             {"sts_temperatures": summary.get("temperatures"),
                              "calibrated": summary["calibrated"]})
        run.finish()
    return {k: v for k, v in summary.items() if k != "report"}


def preflight(ctx: StageContext, ordered: list[str], forced: list[str]) -> None:
    """Check what the stages in ``ordered`` will read, before any of them runs (or is cleared by
    ``--force``): vLLM for ``generate.backend: vllm`` (generate), the benchmark files (eval),
    ``train.init_from`` (train), and that an existing cache at the cache location belongs to this
    target (train, and cache unless forced).

    Raises:
        VllmNotInstalledError, EvalDataError, FileNotFoundError, DrafterCheckpointError,
        CacheMismatchError.
    """
    from .cache import read_manifest

    if ("generate" in ordered and ctx.cfg.generate.backend == "vllm"
            and (not _marker(ctx, "generate").exists() or "generate" in forced)):
        from .generate_vllm import require_vllm

        require_vllm()
    if "eval" in ordered:
        eval_datasets(ctx.cfg)
    init_from = ctx.cfg.train.init_from
    if "train" in ordered and init_from and not storage.is_url(init_from):
        from drafters.loading import check_checkpoint

        check_checkpoint(storage.resolve(init_from))
    so = ctx.cfg.storage_options
    reads_cache = "train" in ordered or ("cache" in ordered and "cache" not in forced)
    if reads_cache and storage.exists(storage.join(ctx.cache_dir, "manifest.json"), so):
        _check_cache_target(ctx, read_manifest(ctx.cache_dir, so))


def eval_datasets(cfg: PipelineConfig) -> dict[str, list[str]]:
    """The eval stage's prompts per benchmark set (``eval.datasets`` under ``eval.data_dir``).
    Cheap: ``pipeline/run.py`` calls it before the first stage, so a bad benchmark file fails the
    run before hours of earlier stages, not after.

    Raises:
        EvalDataError: a missing file or a malformed row (file and line named).
    """
    from .evaluate import load_eval_prompts

    e = cfg.eval
    data_dir = Path(storage.resolve(e.data_dir))
    return {name: load_eval_prompts(data_dir / f"{name}.jsonl", n, e.shuffle_seed)
            for name, n in e.datasets.items()}


def export_engine_files(ctx: StageContext, sps_profile: dict | None, dst: Path) -> dict:
    """Write the calibrated drafter's STS temperatures and the SPS(B) profile the eval engine
    measured in SGLang's and TensorRT-LLM's formats to ``dst`` (``serve/engine_files.py``), with
    the calibrate stage's report for the ECE columns.

    Returns:
        ``{"dst", "written", "skipped"}``.
    """
    from serve.engine_files import EngineFileError, write_engine_files

    drafter = storage.local_copy(ctx.drafter_location("calibrate"), ctx.cfg.storage_options)
    try:
        summary = write_engine_files(drafter, dst, sps_profile=sps_profile,
                                     calibration_report=ctx.run_dir / "calibrate" / "report.json")
    except (EngineFileError, OSError, ValueError, KeyError) as err:  # the evaluation stands
        summary = {"dst": str(dst), "written": [], "skipped": {"sts and sps": str(err)}}
    for what, why in summary["skipped"].items():
        logger.warning("engine files: no %s file: %s", what.upper(), why)
    return summary


def stage_eval(ctx: StageContext) -> dict:
    import ray

    from .tracking import log_evaluation, open_run

    from .evaluate import evaluate, render_report_md
    from .plots import conditional_acceptance_plot, threshold_sweep_plot

    _require(ctx, "calibrate")
    e = ctx.cfg.eval
    datasets = eval_datasets(ctx.cfg)
    ensure_ray(ctx.cfg)
    task = ray.remote(num_cpus=e.cpus, num_gpus=e.gpus or None)(evaluate)
    report = ray.get(task.remote(
        target=ctx.target, dtype=e.dtype, drafter_dir=ctx.drafter_location("calibrate"),
        storage_options=ctx.cfg.storage_options,
        template_kwargs=ctx.cfg.target.chat_template_kwargs, datasets=datasets,
        temperatures=e.temperatures, max_new_tokens=e.max_new_tokens,
        num_threads=e.num_threads, seed=ctx.cfg.seed, speed_baseline=e.speed_baseline,
        baseline_dtype=e.baseline_dtype or e.dtype, engine=ctx.cfg.engine.model_copy(update={"max_num_requests": 1})))
    out = ctx.stage_dir("eval")
    engine_files = export_engine_files(ctx, report.pop("sps_profile", None), out / "engine_files")
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(render_report_md(report))
    for temp in map(str, e.temperatures):
        curves = {name: by_t[temp]["conditional_acceptance"]
                  for name, by_t in report["results"].items()}
        conditional_acceptance_plot(curves, out / f"conditional_acceptance_T{temp}.png",
                                    title=f"P(token k accepted | tokens < k accepted), T = {temp}")
        sweeps = [(name, by_t[temp]["threshold_sweep"]) for name, by_t in report["results"].items()
                  if by_t[temp].get("threshold_sweep")]
        for name, sweep in sweeps:
            threshold_sweep_plot(sweep, out / f"threshold_sweep_{name}_T{temp}.png",
                                 title=f"Static confidence threshold, {name}, T = {temp}")
    run = open_run(ctx.cfg.wandb.model_dump(), ctx.run_dir, ctx.run_dir.name, "eval")
    if run is not None:
        log_evaluation(run, report, out)
        run.finish()
    return {"domains": report["domains"], "engine_files": engine_files,
            **{name: {t: {"tau": round(s["tau"], 3),
                          "speedup": None if s["speedup"] is None else round(s["speedup"], 3)}
                      for t, s in by_t.items()} for name, by_t in report["results"].items()}}


STAGE_FUNCS = {"prompts": stage_prompts, "generate": stage_generate, "cache": stage_cache,
               "train": stage_train, "calibrate": stage_calibrate, "eval": stage_eval}
