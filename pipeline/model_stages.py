"""The model stages: train (Ray Train + DeepSpeed on the target cache), calibrate (STS of the
confidence head on held-out prompts), eval (speculative decoding vs the target alone)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from serve.engine.engine_files import EngineFileError, write_engine_files

from . import storage
from .cache.format import read_manifest
from .calibrate import collect_rounds, fit_and_report
from .config import PipelineConfig
from .evaluate import evaluate, load_eval_prompts, render_report_md
from .plots import conditional_acceptance_plot, threshold_sweep_plot
from .prompts import read_jsonl
from .run_layout import CACHE, CALIBRATE, EVAL, TRAIN
from .stage_context import StageContext, ensure_ray
from .tracking import log_calibration, log_drafter_artifact, log_evaluation, open_run
from .train.data import subset_manifest
from .train.driver import run_train
from .train.modes import train_hybrid, train_online
from .train.vs_serve import train_vs_serve

logger = logging.getLogger(__name__)


def stage_train(ctx: StageContext) -> dict:
    mode, so = ctx.cfg.train.data_mode, ctx.cfg.storage_options
    has_cache = storage.exists(storage.join(ctx.cache_dir, "manifest.json"), so)
    extra = {"data_mode": mode}
    if mode == "online":
        result = train_online(ctx)
    elif mode == "hybrid" and not has_cache:
        result = train_hybrid(ctx)
        extra["phases"] = result["phases"]
    else:  # offline, or hybrid once its cache is finished
        if not has_cache and json.loads(ctx.marker(CACHE).read_text()).get("skipped"):
            raise ValueError(f"no cache at {ctx.cache_dir}: the cache stage was skipped because "
                             "train.data_mode was not offline when it ran; pass --force cache")
        manifest = read_manifest(ctx.cache_dir, so)
        ctx.check_cache_target(manifest)
        manifest = subset_manifest(manifest, ctx.cfg.train.max_train_rows, ctx.cfg.seed)
        ensure_ray(ctx.cfg)
        result = run_train(
            cache_dir=ctx.cache_dir, manifest=manifest, out_dir=ctx.stage_dir(TRAIN),
            target=ctx.target, layer_ids=ctx.layer_ids, drafter=ctx.cfg.drafter,
            train=ctx.cfg.train, wandb_cfg=ctx.cfg.wandb.model_dump(),
            storage_options=so, run_name=ctx.run_dir.name)
    return {**extra, "steps": result["steps"], "rows": result["rows"],
            "drafter": str(ctx.layout.drafter(TRAIN)),
            "published": ctx.publish_drafter(TRAIN), "draft_vocab": result["draft_vocab"],
            "final_metrics": {k: v for k, v in result["metrics"].items()
                              if isinstance(v, (int, float))}}


def _heldout_prompts(ctx: StageContext, limit: int) -> list[str]:
    """First user turns of the held-out conversations (falls back to training prompts with a
    warning when the split is empty, e.g. heldout_fraction 0)."""
    rows = read_jsonl(str(ctx.layout.prompts("heldout")))
    if not rows:
        logger.warning("no held-out prompts: calibrating on training prompts instead")
        rows = read_jsonl(str(ctx.layout.prompts("train")))
    return [r["messages"][0]["content"] for r in rows[:limit]]


def stage_calibrate(ctx: StageContext) -> dict:
    import ray

    c = ctx.cfg.calibrate
    ensure_ray(ctx.cfg)
    task = ray.remote(num_cpus=c.cpus, num_gpus=c.gpus or None)(collect_rounds)
    drafter_dir = ctx.drafter_location(TRAIN)
    so = ctx.cfg.storage_options
    collected = ray.get(task.remote(
        target=ctx.target, dtype=c.dtype, drafter_dir=drafter_dir,
        template_kwargs=ctx.cfg.target.chat_template_kwargs,
        prompts=_heldout_prompts(ctx, c.max_prompts), temperature=c.temperature,
        max_new_tokens=c.max_new_tokens, seed=ctx.cfg.seed, num_threads=c.num_threads,
        storage_options=so))
    out = ctx.stage_dir(CALIBRATE)
    summary = fit_and_report(collected, out, storage.local_copy(drafter_dir, so), ctx.cfg.seed)
    summary["published"] = ctx.publish_drafter(CALIBRATE)
    run = open_run(ctx.cfg.wandb.model_dump(), ctx.run_dir, ctx.run_dir.name, CALIBRATE)
    if run is not None:
        log_calibration(run, summary.get("report") or {}, out)
        log_drafter_artifact(run, out / "drafter", f"drafter-calibrated-{ctx.run_dir.name}",
                             {"sts_temperatures": summary.get("temperatures"),
                              "calibrated": summary["calibrated"]})
        run.finish()
    return {k: v for k, v in summary.items() if k != "report"}


def eval_datasets(cfg: PipelineConfig) -> dict[str, list[str]]:
    """The eval stage's prompts per benchmark set (``eval.datasets`` under ``eval.data_dir``).
    Cheap: ``pipeline/run.py`` calls it before the first stage, so a bad benchmark file fails the
    run before hours of earlier stages, not after.

    Raises:
        EvalDataError: a missing file or a malformed row (file and line named).
    """
    e = cfg.eval
    data_dir = Path(storage.resolve(e.data_dir))
    return {name: load_eval_prompts(data_dir / f"{name}.jsonl", n, e.shuffle_seed)
            for name, n in e.datasets.items()}


def export_engine_files(ctx: StageContext, sps_profile: dict | None, dst: Path) -> dict:
    """Write the calibrated drafter's STS temperatures and the SPS(B) profile the eval engine
    measured in SGLang's and TensorRT-LLM's formats to ``dst``
    (``serve/engine/engine_files.py``), with the calibrate stage's report for the ECE columns.

    Returns:
        ``{"dst", "written", "skipped"}``.
    """
    drafter = storage.local_copy(ctx.drafter_location(CALIBRATE), ctx.cfg.storage_options)
    try:
        summary = write_engine_files(drafter, dst, sps_profile=sps_profile,
                                     calibration_report=ctx.layout.calibration_report)
    except (EngineFileError, OSError, ValueError, KeyError) as err:  # the evaluation stands
        summary = {"dst": str(dst), "written": [], "skipped": {"sts and sps": str(err)}}
    for what, why in summary["skipped"].items():
        logger.warning("engine files: no %s file: %s", what.upper(), why)
    return summary


def _train_vs_serve(ctx: StageContext) -> dict | None:
    """:func:`pipeline.train.vs_serve.train_vs_serve` of this run's training log and calibrate report
    (None when either is missing, e.g. a drafter trained elsewhere); a flagged gap is logged."""
    log, calibration = ctx.layout.training_log, ctx.layout.calibration_report
    if not log.is_file() or not calibration.is_file():
        return None
    try:
        history = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        calibrated = json.loads(calibration.read_text())
    except (OSError, ValueError) as err:  # the evaluation just measured stands without it
        logger.warning("eval: no train vs serve check: %s or %s unreadable (%s)", log,
                       calibration, err)
        return None
    result = train_vs_serve(history, calibrated, ctx.cfg.generate.sampling.model_dump())
    if result and result["flagged"]:
        logger.warning("eval: the trainer's held-out tau %.2f against the served tau %.2f %s "
                       "(%s rule): a train/serve mismatch? (eval/report.md)",
                       result["trainer_heldout_tau"], result["served_tau"],
                       result["served_tau_interval"], result["flag_rule"])
    return result


def stage_eval(ctx: StageContext) -> dict:
    import ray

    e = ctx.cfg.eval
    datasets = eval_datasets(ctx.cfg)
    ensure_ray(ctx.cfg)
    task = ray.remote(num_cpus=e.cpus, num_gpus=e.gpus or None)(evaluate)
    report = ray.get(task.remote(
        target=ctx.target, dtype=e.dtype, drafter_dir=ctx.drafter_location(CALIBRATE),
        storage_options=ctx.cfg.storage_options,
        template_kwargs=ctx.cfg.target.chat_template_kwargs, datasets=datasets,
        temperatures=e.temperatures, max_new_tokens=e.max_new_tokens,
        num_threads=e.num_threads, seed=ctx.cfg.seed, speed_baseline=e.speed_baseline,
        baseline_dtype=e.baseline_dtype or e.dtype,
        engine=ctx.cfg.engine.model_copy(update={"max_num_requests": 1}),
        fixed_gamma_pass=e.fixed_gamma_pass))
    report["train_vs_serve"] = _train_vs_serve(ctx)
    out = ctx.stage_dir(EVAL)
    engine_files = export_engine_files(ctx, report.pop("sps_profile", None),
                                       ctx.layout.engine_files)
    ctx.layout.eval_report("json").write_text(json.dumps(report, indent=1))
    ctx.layout.eval_report("md").write_text(render_report_md(report))
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
    run = open_run(ctx.cfg.wandb.model_dump(), ctx.run_dir, ctx.run_dir.name, EVAL)
    if run is not None:
        log_evaluation(run, report, out)
        run.finish()
    return {"domains": report["domains"], "domain_intervals": report["domain_intervals"],
            "train_vs_serve": report["train_vs_serve"],
            "engine_files": engine_files,
            **({"fixed_gamma_domains": report["fixed_gamma"]["domains"]}
               if "fixed_gamma" in report else {}),
            **{name: {t: {"tau": None if s["tau"] is None else round(s["tau"], 3),
                          "speedup": None if s["speedup"] is None else round(s["speedup"], 3)}
                      for t, s in by_t.items()} for name, by_t in report["results"].items()}}
