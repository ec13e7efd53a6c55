"""Eval stage: speculative decoding with the trained drafter on the benchmark files (SPEC section 5).

For every prompt and temperature the prompt is decoded twice, with plain transformers ``generate``
(the baseline users already have, ``eval.baseline_dtype``) and speculatively by the engine,
alternating which goes first so that machine drift affects both alike. Reported per dataset and
temperature: tau (mean committed tokens per round, bonus included), prefix survival accept_rate@k,
conditional acceptance per position, tokens/s of both and their ratio, draft and verify time per
round, and (greedy, when both run in the same dtype) the share of prompts whose speculative output
is token-identical to plain ``generate``'s.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
from tqdm import tqdm

from drafters.calibration import calibration_report, cumulative_survival, static_threshold_sweep
from drafters.precision import dtype_name, resolve_dtype_name
from serve.engine.builder import load_models
from serve.engine.chat import render_prompt_ids
from serve.engine.decoding import SpeculativeDecoder
from serve.engine.metrics import SpecDecodeStats
from serve.engine.profiling import PROFILE_NAME
from serve.engine.target_loading import load_target

from .baselines import hf_generate
from .tau_intervals import METHOD as INTERVAL_METHOD
from .tau_intervals import domain_intervals, format_interval, prompt_counts, tau_interval
from .train.vs_serve import train_vs_serve_lines

# benchmark file stem -> domain (SPEC 5; paper Table 1 groups math, code and chat)
DOMAINS = {"gsm8k": "math", "math500": "math", "aime24": "math", "aime25": "math",
           "humaneval": "code", "mbpp": "code", "livecodebench": "code", "lbpp": "code",
           "swe-bench": "code", "mt-bench": "chat", "alpaca": "chat", "arena-hard-v2": "chat"}


def domain_of(datasets) -> dict[str, str]:
    """dataset -> its domain (``DOMAINS``; ``"other"`` for a set not listed there)."""
    return {name: DOMAINS.get(name, "other") for name in datasets}


THRESHOLDS = [round(0.05 * i, 2) for i in range(20)]


class EvalDataError(ValueError):
    """A benchmark file is missing or has a malformed row (file and line named)."""


def load_eval_prompts(path: Path, count: int, seed: int) -> list[str]:
    """First user turns of a benchmark file (``{"turns": [...]}`` rows), a seeded sample of
    ``count`` (DeepSpec's convention: shuffle with ``random.Random(seed)`` when the file has more).

    Raises:
        EvalDataError: missing file or a malformed row.
    """
    path = Path(path)
    if not path.is_file() and path.with_name(path.name + ".gz").is_file():
        path = path.with_name(path.name + ".gz")  # the repository ships its sets compressed
    if not path.is_file():
        raise EvalDataError(f"benchmark file not found: {path} (nor {path.name}.gz)")
    prompts = []
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            lines = fh.readlines()
    except (OSError, EOFError, UnicodeDecodeError) as err:  # a damaged .gz, a binary file
        raise EvalDataError(f"{path}: unreadable ({type(err).__name__}: {err})") from err
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            turns = json.loads(raw)["turns"]
            if not isinstance(turns, list) or not isinstance(turns[0], str) or not turns[0].strip():
                raise ValueError("'turns' must be a non-empty list of non-empty strings")
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as err:
            raise EvalDataError(f"{path}:{line_no}: {err}") from err
        prompts.append(turns[0])
    if len(prompts) > count:
        random.Random(seed).shuffle(prompts)
        prompts = prompts[:count]
    return prompts


def summarize(records: list[dict], gamma: int, sts_temperatures: list[float] | None = None) -> dict:
    """Aggregate per-prompt records of one (dataset, sampling temperature) cell.

    ``records[i]["spec_rounds"]`` are the engine's :class:`serve.engine.core.RoundRecord` s; tau,
    accept_rate@k and conditional acceptance come from :class:`serve.engine.metrics.SpecDecodeStats`
    (one definition). ``sts_temperatures`` are the drafter's calibration temperatures T_1..T_gamma
    (None = uncalibrated)."""
    # rounds that verified nothing (the scheduler or planner declined, the budget's last token,
    # beyond the drafter's context) are plain target steps and say nothing about the drafter
    rounds = [r for rec in records for r in rec["spec_rounds"] if r.verified > 0]
    stats = SpecDecodeStats()
    for r in rounds:
        stats.record_round(r.drafted, r.verified, r.accepted, r.committed)
    zeros = [0] * max(0, gamma - len(stats.verified_per_position))
    verified = list(stats.verified_per_position) + zeros
    reached = list(stats.reached_per_position) + zeros
    # a rate over no rounds is unmeasured: None (JSON null), never 0.0, which would read as "the
    # drafter fails there" in tables and plots
    survival = [r if n else None for r, n in zip(stats.accept_rate_at_k() + zeros, verified)]
    conditional = [r if n else None
                   for r, n in zip(stats.conditional_acceptance() + zeros, reached)]
    full = [r for r in rounds if r.verified == gamma]  # rounds that verified the full block
    spec_tokens = sum(rec["spec_tokens"] for rec in records)
    base_tokens = sum(rec["base_tokens"] for rec in records)
    spec_s = sum(rec["spec_s"] for rec in records)
    base_s = sum(rec["base_s"] for rec in records)
    spec_tps = spec_tokens / spec_s if spec_s else 0.0
    base_tps = base_tokens / base_s if base_s else 0.0
    per_prompt = prompt_counts([rec["spec_rounds"] for rec in records])
    out = {
        "prompts": len(records),
        "rounds": len(rounds),
        # no round verified a draft (the planner never drafted here): tau is unmeasured, None,
        # never 0.0, which would pull the domain and macro means below 1 (a round commits >= 1)
        "tau": stats.tau if rounds else None,
        "tau_interval": tau_interval(per_prompt),  # 95 %, bootstrap over prompts
        "per_prompt": per_prompt,  # [committed, rounds] per prompt: what intervals resample
        "accept_rate": survival,
        "conditional_acceptance": conditional,
        # the rates' denominators: a confidence scheduler verifies deep positions rarely, and a
        # rate over no rounds is unmeasured, not 0 (the report prints "-")
        "verified_per_position": verified,
        "reached_per_position": reached,
        "spec_tokens_per_s": spec_tps,
        "target_tokens_per_s": base_tps,
        "speedup": spec_tps / base_tps if base_tps else 0.0,
        "draft_ms_per_round": 1e3 * sum(r.draft_s for r in rounds) / len(rounds) if rounds else None,
        "verify_ms_per_round": 1e3 * sum(r.verify_s for r in rounds) / len(rounds) if rounds else None,
        "spec_tokens": spec_tokens,
        "target_tokens": base_tokens,
    }
    if records and records[0].get("identical") is not None:
        out["greedy_identical_share"] = sum(rec["identical"] for rec in records) / len(records)
    if not base_s:  # speed not measured (eval.speed_baseline false)
        out["speedup"] = out["target_tokens_per_s"] = None
    out.update(confidence_summary([r for r in full if r.confidence_logits is not None], gamma,
                                  sts_temperatures))
    return out


def _rate_cells(rates: list[float | None], counts: list[int] | None) -> list[str]:
    """Table cells for per-position rates: ``"-"`` where the rate is unmeasured (None, or its
    denominator, the rounds, is 0)."""
    counts = counts if counts is not None else [1] * len(rates)
    return [f"{r:.2f}" if n and r is not None else "-" for r, n in zip(rates, counts)]


def confidence_summary(full_rounds: list, gamma: int, sts_temperatures: list[float] | None) -> dict:
    """Calibration metrics and the static-threshold sweep (paper Fig. 5) over full-gamma rounds
    that recorded confidence logits (DSpark only); empty for drafters without a confidence head."""
    if not full_rounds:
        return {}

    z = np.array([r.confidence_logits for r in full_rounds], dtype=np.float64)
    accepted = np.array([r.accepted for r in full_rounds])
    temps = sts_temperatures or [1.0] * gamma
    report = calibration_report(z, accepted, temps)
    sweep = static_threshold_sweep(cumulative_survival(z, temps), accepted, THRESHOLDS)
    return {"calibration": report, "threshold_sweep": sweep}


def domain_summary(results: dict, temperature: str) -> dict:
    """Per-domain mean tau (mean over the domain's datasets) and the macro average over domains
    (their intervals: :func:`domain_summary_intervals`). A dataset whose tau is unmeasured (None:
    no round drafted) is left out of its domain's mean, a domain with none measured out of the
    macro."""
    by_domain: dict[str, list[float]] = {}
    domains = domain_of(results)
    for name, by_t in results.items():
        cell = by_t.get(temperature)
        # (reports written before None meant "unmeasured" say tau 0.0 with rounds 0)
        if cell is not None and cell["tau"] is not None and cell.get("rounds", 1):
            by_domain.setdefault(domains[name], []).append(cell["tau"])
    out = {d: sum(v) / len(v) for d, v in by_domain.items()}
    if out:
        out["macro"] = sum(out.values()) / len(out)
    return out


def domain_cells(results: dict, temperature: str) -> dict[str, list[list[int]]]:
    """dataset -> its per-prompt ``[committed, rounds]`` at ``temperature`` (what the intervals
    resample)."""
    return {name: by_t[temperature].get("per_prompt", []) for name, by_t in results.items()
            if temperature in by_t}


def domain_summary_intervals(results: dict, temperature: str) -> dict:
    """95 % intervals of :func:`domain_summary`'s taus: ``{domain: [low, high], "macro": ...}``
    (bootstrap over prompts, ``pipeline.tau_intervals``)."""
    cells = domain_cells(results, temperature)
    return domain_intervals(cells, domain_of(cells))


def evaluate(*, target: str, dtype: str, drafter_dir: str, template_kwargs: dict,
             datasets: dict[str, list[str]], temperatures: list[float], max_new_tokens: int,
             num_threads: int | None, seed: int, progress: bool = True,
             speed_baseline: bool = True, baseline_dtype: str | None = None,
             engine=None, storage_options: dict | None = None,
             fixed_gamma_pass: bool = False) -> dict:
    """Run the evaluation in this process (the pipeline runs it inside a Ray task).

    Args:
        datasets: dataset name -> prompts (first user turns).
        speed_baseline: also decode with plain ``generate`` (in ``baseline_dtype``; None: the
            engine's dtype) to measure the speed-up (doubles the time).
        engine: ``serve.engine.config.EngineConfig`` of the speculative engine (its scheduler); None =
            fixed gamma-token verification.
        fixed_gamma_pass: when the engine's scheduler is not fixed, decode every prompt again
            verifying the whole gamma-token block each round, without prompt lookup or baseline
            (the drafter's own tau at gamma, paper Table 1 / SPEC 7).
        drafter_dir: local directory or URL (``s3://``, read with ``storage_options``; fetched
            on the node this runs on).
    Returns:
        ``{"gamma", "drafter", "results": {dataset: {str(temperature): summary}},
        "domains": {str(temperature): {domain: tau, "macro": tau}}, "sps_profile",
        "fixed_gamma": {"results": ..., "domains": ...} (with ``fixed_gamma_pass``), ...}``
        (``sps_profile``: the stored ``sps_profile.json`` payload, None when the scheduler
        profiled none).
    Raises:
        FileNotFoundError / ValueError: missing drafter, or one trained for another target.
    """
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    # inside a Ray task with eval/calibrate gpus > 0 CUDA is visible: decode there
    models = load_models(target, dtype, drafter_dir, storage_options=storage_options)
    tokenizer, model, drafter, eos = models.tokenizer, models.model, models.drafter, models.eos
    # "auto" resolved on this task's device: the report names the dtypes that ran
    dtype = dtype_name(models.runner.dtype)
    baseline_dtype = (resolve_dtype_name(baseline_dtype, models.runner.device)
                      if speed_baseline and baseline_dtype is not None else dtype)
    decoder = SpeculativeDecoder(models.runner, drafter, eos, engine, sps_dir=models.drafter_dir)
    plain = (model if baseline_dtype == dtype
             else load_target(target, baseline_dtype).to(model.device)) if speed_baseline else None
    pad = tokenizer.pad_token_id
    gamma = drafter.config.block_size
    cells: dict[tuple[str, float], list[dict]] = {}
    for name, temp, i, ids in _rendered_prompts(tokenizer, datasets, temperatures,
                                                template_kwargs, "eval", progress):
        req_seed = seed + i
        order = ("base", "spec") if i % 2 == 0 else ("spec", "base")
        if not speed_baseline:
            order = ("spec",)
        outs = {}
        for kind in order:
            outs[kind] = (hf_generate(plain, ids, max_new_tokens, temp, req_seed, eos, pad)
                          if kind == "base" else
                          decoder.generate(ids, max_new_tokens, temp, req_seed))
        spec, base = outs["spec"], outs.get("base")
        same_dtype = baseline_dtype == dtype
        cells.setdefault((name, temp), []).append({
            "spec_tokens": len(spec.tokens), "spec_s": spec.total_s,
            "base_tokens": len(base.tokens) if base else 0,
            "base_s": base.seconds if base else 0.0,
            "spec_rounds": spec.rounds,
            "identical": (spec.tokens == base.tokens)
            if temp <= 0 and base and same_dtype else None,
        })
    results = _summaries(cells, datasets, temperatures, gamma,
                         drafter.config.calibration_temperatures)
    fixed = None
    if fixed_gamma_pass and decoder.scheduler != "fixed":
        fixed = _fixed_gamma_results(decoder, tokenizer, datasets, temperatures,
                                     template_kwargs, max_new_tokens, seed, gamma,
                                     drafter.config.calibration_temperatures, progress)
    # the SPS(B) profile the engine measured or reused, for the engine files the eval stage
    # writes (serve/engine/engine_files.py): read here because a remote drafter's local copy (where the
    # profile is stored) lives on this task's node only
    profile = Path(models.drafter_dir or "") / PROFILE_NAME
    stored = json.loads(profile.read_text()) if models.drafter_dir and profile.is_file() else None
    return {"gamma": gamma, "drafter": drafter_dir, "sps_profile": stored,
            "drafter_type": drafter.config.drafter_type,
            "scheduler": decoder.scheduler,
            "trainable_parameters": drafter.num_trainable_parameters(), "target": target,
            "dtype": dtype, "baseline": f"transformers generate ({baseline_dtype})"
            if speed_baseline else None, "max_new_tokens": max_new_tokens, "results": results,
            "domains": {str(t): domain_summary(results, str(t)) for t in temperatures},
            "domain_intervals": {str(t): domain_summary_intervals(results, str(t))
                                 for t in temperatures},
            "interval_method": INTERVAL_METHOD,
            **({"fixed_gamma": {"results": fixed, "domains": {
                str(t): domain_summary(fixed, str(t)) for t in temperatures},
                "domain_intervals": {str(t): domain_summary_intervals(fixed, str(t))
                                     for t in temperatures}}} if fixed else {})}


def _rendered_prompts(tokenizer, datasets: dict[str, list[str]], temperatures: list[float],
                      template_kwargs: dict, desc: str, progress: bool):
    """Yield ``(dataset, temperature, prompt index, prompt ids)`` for every prompt at every
    temperature, in the eval's order, with a progress bar."""
    total = sum(len(p) for p in datasets.values()) * len(temperatures)
    bar = tqdm(total=total, desc=desc, unit="prompt", mininterval=5, disable=not progress)
    for name, prompts in datasets.items():
        for temp in temperatures:
            for i, text in enumerate(prompts):
                yield name, temp, i, render_prompt_ids(
                    tokenizer, [{"role": "user", "content": text}], template_kwargs)
                bar.update(1)
    bar.close()


def _summaries(cells: dict, datasets: dict, temperatures: list[float], gamma: int,
               sts_temperatures: list[float] | None) -> dict:
    """``{dataset: {str(temperature): summarize(records)}}`` of ``{(dataset, temperature):
    records}``."""
    return {name: {str(t): summarize(cells.get((name, t), []), gamma, sts_temperatures)
                   for t in temperatures} for name in datasets}


def _fixed_gamma_results(decoder, tokenizer, datasets: dict[str, list[str]],
                         temperatures: list[float], template_kwargs: dict, max_new_tokens: int,
                         seed: int, gamma: int, sts_temperatures: list[float] | None,
                         progress: bool) -> dict:
    """``{dataset: {str(temperature): summary}}`` of ``decoder`` verifying ``gamma`` draft
    tokens every round (its fixed engine) on the same prompts and request seeds as the main pass:
    tau, acceptance and calibration over full-block rounds, no speed baseline."""
    cells: dict[tuple[str, float], list[dict]] = {}
    for name, temp, i, ids in _rendered_prompts(tokenizer, datasets, temperatures,
                                                template_kwargs, "eval (fixed gamma)", progress):
        spec = decoder.generate(ids, max_new_tokens, temp, seed + i, num_draft_tokens=gamma)
        cells.setdefault((name, temp), []).append(
            {"spec_tokens": len(spec.tokens), "spec_s": spec.total_s, "base_tokens": 0,
             "base_s": 0.0, "spec_rounds": spec.rounds})
    return _summaries(cells, datasets, temperatures, gamma, sts_temperatures)


def _domain_table(domains: dict, intervals: dict | None = None) -> list[str]:
    """Markdown rows: mean tau per domain and the macro average, one row per temperature, each
    with its 95 % interval where ``intervals`` has one."""
    names = sorted({d for by_d in domains.values() for d in by_d if d != "macro"})
    intervals = intervals or {}
    lines = ["| temperature | " + " | ".join(names) + " | macro |",
             "|---|" + "---|" * (len(names) + 1)]
    for temp, by_d in domains.items():
        ci = intervals.get(temp, {})
        lines.append(f"| {temp} | " + " | ".join(
            format_interval(by_d[d], ci.get(d)) if d in by_d else "-" for d in names) +
            f" | {format_interval(by_d.get('macro'), ci.get('macro'))} |")
    return lines


def _cells_with(report: dict, key: str) -> list[tuple[str, str, object]]:
    """(dataset, temperature, summary[key]) of every cell that has ``key``."""
    return [(name, temp, s[key]) for name, by_t in report["results"].items()
            for temp, s in by_t.items() if s.get(key)]


def render_report_md(report: dict) -> str:
    """The ``report.md`` table."""
    gamma = report["gamma"]
    lines = [
        f"# Evaluation: {report['target']} ({report['dtype']}), drafter gamma = {gamma}, "
        f"scheduler {report.get('scheduler', 'fixed')}",
        "",
        f"max_new_tokens = {report['max_new_tokens']}; tau counts the bonus token; tokens/s are "
        "measured in the same run on the same prompts, plain decoding "
        f"({report.get('baseline') or 'not measured'}) and speculative alternating; speed-up = "
        "speculative tokens/s / plain tokens/s. tau [brackets]: "
        f"{report.get('interval_method', INTERVAL_METHOD)}. 'greedy identical' (only when both "
        "run in the same dtype) compares the two outputs token by token: in bf16, verifying several tokens in one "
        "pass can flip near-ties against one-token steps, so it may read below 100 %; "
        "losslessness itself is tested in fp32 (tests/unit/test_speculative_lossless.py, "
        "benchmarks/spec_vs_target.py).",
        "",
        "| dataset | temperature | prompts | tau | accept_rate@1..k | spec tok/s | plain tok/s "
        "| speed-up | draft ms/round | verify ms/round | greedy identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by_temp in report["results"].items():
        for temp, s in by_temp.items():
            rates = " / ".join(_rate_cells(s["accept_rate"], s.get("verified_per_position")))
            same = s.get("greedy_identical_share")
            base, speedup = s["target_tokens_per_s"], s["speedup"]
            lines.append(
                f"| {name} | {temp} | {s['prompts']} | "
                f"{format_interval(s['tau'], s.get('tau_interval'))} | {rates} | "
                f"{s['spec_tokens_per_s']:.1f} | {'-' if base is None else f'{base:.1f}'} | "
                f"{'-' if speedup is None else f'{speedup:.2f}x'} | "
                f"{format_interval(s['draft_ms_per_round'], None, 1)} | "
                f"{format_interval(s['verify_ms_per_round'], None, 1)} | "
                f"{'' if same is None else f'{same:.0%}'} |")
    lines += ["", "Conditional acceptance per position (P(token k accepted | tokens < k accepted)); "
              "'-': no round verified (or reached) position k, as when a confidence scheduler "
              "never verifies that deep:", ""]
    lines.append("| dataset | temperature | " + " | ".join(f"k={k}" for k in range(1, gamma + 1)) + " |")
    lines.append("|---|---|" + "---|" * gamma)
    for name, by_temp in report["results"].items():
        for temp, s in by_temp.items():
            lines.append(f"| {name} | {temp} | " +
                         " | ".join(_rate_cells(s["conditional_acceptance"],
                                                s.get("reached_per_position"))) + " |")
    domains = report.get("domains", {})
    if domains:
        lines += ["", "Mean tau per domain (mean over the domain's datasets) and macro average:", ""]
        lines += _domain_table(domains, report.get("domain_intervals"))
    fixed = report.get("fixed_gamma")
    if fixed:
        lines += ["", f"The drafter at fixed gamma = {gamma} (the same prompts and seeds, every "
                  "round verifying the whole block, no prompt lookup: the drafter's own tau, the "
                  "convention of the paper's Table 1):", "",
                  "| dataset | temperature | rounds | tau | accept_rate@1..k | conditional "
                  "acceptance k=1..k |", "|---|---|---|---|---|---|"]
        for name, by_temp in fixed["results"].items():
            for temp, s in by_temp.items():
                rates = " / ".join(_rate_cells(s["accept_rate"], s.get("verified_per_position")))
                cond = " / ".join(_rate_cells(s["conditional_acceptance"],
                                              s.get("reached_per_position")))
                lines.append(f"| {name} | {temp} | {s['rounds']} | "
                             f"{format_interval(s['tau'], s.get('tau_interval'))} | {rates} | "
                             f"{cond} |")
        lines += ["", f"Mean tau per domain at fixed gamma = {gamma} and macro average:", ""]
        lines += _domain_table(fixed["domains"], fixed.get("domain_intervals"))
    if report.get("train_vs_serve"):
        lines += train_vs_serve_lines(report["train_vs_serve"])
    cal_rows = _cells_with(report, "calibration")
    if cal_rows:
        lines += ["", "Calibration of the prefix survival a_k on these rounds (ECE, 20 bins; 'after' "
                  "uses the checkpoint's STS temperatures):", "",
                  "| dataset | temperature | full rounds | mean ECE before | mean ECE after |",
                  "|---|---|---|---|---|"]
        for name, temp, c in cal_rows:
            fmt = lambda v: "-" if v is None else f"{v:.3f}"
            lines.append(f"| {name} | {temp} | {c['num_rounds']} | "
                         f"{fmt(c['mean']['ece_before'])} | {fmt(c['mean']['ece_after'])} |")
    sweeps = _cells_with(report, "threshold_sweep")
    if sweeps:
        lines += ["", "Static confidence threshold on the same rounds (paper Fig. 5; offline: each "
                  "round verifies its draft prefix whose calibrated survival a_k >= threshold):", "",
                  "| dataset | temperature | threshold | tokens/step | accepted/step | "
                  "rejected/step | acceptance rate |", "|---|---|---|---|---|---|---|"]
        for name, temp, sweep in sweeps:
            for row in sweep[::4]:
                lines.append(f"| {name} | {temp} | {row['threshold']:.2f} | "
                             f"{row['committed_per_step']:.2f} | {row['accepted_per_step']:.2f} | "
                             f"{row['rejected_per_step']:.2f} | {row['acceptance_rate']:.2f} |")
    return "\n".join(lines) + "\n"
