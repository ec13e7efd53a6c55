"""DSpark vs DFlash vs Eagle3 at the same budget: accepted length tau per benchmark and domain.

All three drafters train on the same regenerated data (one prompts/generate/cache run, shared),
for the same number of optimizer steps, and are evaluated on the same prompts at temperature 1
(SPEC 5, paper Table 1). DSpark's confidence head is calibrated (STS) on held-out prompts first.
Writes ``benchmarks/results/drafter_quality/<date>_<machine class>.{md,json}`` and plots next to them.

    .venv/bin/python benchmarks/drafter_quality.py [--config infra/configs/drafter_quality.yaml]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from drafters.precision import resolve_dtype_name  # noqa: E402
from pipeline.run_layout import (CACHE, CALIBRATE, GENERATE, PROMPTS, STAGE_ORDER, TRAIN,  # noqa: E402
                                 RunLayout, link_stages)

from pipeline import stages, storage  # noqa: E402
from pipeline.config import ConfigError, load_config  # noqa: E402
from pipeline.evaluate import domain_cells, domain_of  # noqa: E402
from pipeline.tau_intervals import METHOD as INTERVAL_METHOD  # noqa: E402
from pipeline.tau_intervals import format_interval, paired_difference  # noqa: E402

# drafter section overrides of each contender (DSpark's comes from the config itself)
DFLASH = {"drafter_type": "dflash", "head_type": "none", "confidence_head": False}
EAGLE3 = {"drafter_type": "eagle3", "head_type": "none", "confidence_head": False,
          "init": "random"}  # an Eagle3 layer reads a 2H-wide input: no target-layer start
CONTENDERS = {
    "dspark": {},
    "dflash": DFLASH,
    "eagle3": EAGLE3,
    # DSpark ablations (--contenders): which design choice explains DSpark's standing
    # the sequential head off (the confidence head reads its embedding, so it goes too; the
    # benchmark verifies fixed gamma blocks, which needs no confidence)
    "dspark-no_markov": {"head_type": "none", "confidence_head": False},
    "dspark-rnn": {"head_type": "rnn"},
    "dspark-markov_rank_64": {"markov_rank": 64},
    "dspark-block_4": {"block_size": 4},
    "dspark-loss_decay_4": {"loss_decay": 4.0},  # the reference repository's decay
    "dspark-layers_1": {"num_layers": 1},
    "dspark-layers_3": {"num_layers": 3},
    # a key with a dot names another section's field: Eagle3's soft-CE-like weighting of the loss
    # terms (ce, tv, conf) instead of DSpark's 0.1 CE + 0.9 TV (greedy decoding checks the argmax)
    "dspark-ce_heavy": {"train.loss_weights": [0.9, 0.1, 1.0]},
    # DSpark's architecture with Eagle3's objective (soft cross-entropy against the target's
    # distribution, plus the confidence term): objective or architecture behind a gap to Eagle3
    "dspark-soft_ce": {"train.objective": "soft_ce"},
    # the first-slot ablation (issue 42): the anchor also reads H_ctx[p-1], the last context
    # position's fused target state that Eagle3's first step reads
    "dspark-anchor_features": {"anchor_features": True},
    # the paper's structural claims at equal data and steps: a 2-layer DSpark against a 5-layer
    # DFlash, and every type at gamma 15 against its gamma 7
    "dflash-layers_5": {**DFLASH, "num_layers": 5},
    "dspark-block_15": {"block_size": 15},
    "dflash-block_15": {**DFLASH, "block_size": 15},
    "eagle3-block_15": {**EAGLE3, "block_size": 15},
}
DEFAULT_CONTENDERS = "dspark,dflash,eagle3"
SHARED_STAGES = (PROMPTS, GENERATE, CACHE)
MODEL_STAGES = (TRAIN, CALIBRATE)  # what --trained-from takes, so only eval runs again


def contender_config(base, name: str, overrides: list[str]):
    """The base config with the contender's overrides (drafter fields, or ``section.field``) and
    its own run directory."""
    extra = [f"{k if '.' in k else 'drafter.' + k}={json.dumps(v)}"
             for k, v in CONTENDERS[name].items()]
    cfg = load_config(base, overrides + extra)
    cfg.run_dir = str(Path(cfg.run_dir) / name)
    return cfg


def missing_trained_stages(trained_from: Path, names: list[str]) -> list[str]:
    """The ``<contender>/<stage>`` of ``trained_from`` that have no completion marker (empty: every
    contender there was trained and calibrated)."""
    return [f"{name}/{stage}" for name in names for stage in MODEL_STAGES
            if not RunLayout(trained_from / name).marker(stage).exists()]


def run_contender(cfg, timings: dict, name: str) -> dict:
    ctx = stages.StageContext.create(cfg)
    for stage in STAGE_ORDER:
        start = time.time()
        summary = stages.run_stage(ctx, stage)
        if "seconds" in summary and time.time() - start > 1:
            timings[f"{name}.{stage}"] = summary["seconds"]
    return {
        "report": json.loads(ctx.layout.eval_report("json").read_text()),
        "calibration": json.loads(ctx.layout.calibration_report.read_text()),
        "train": json.loads(ctx.layout.marker(TRAIN).read_text()),
        "run_dir": str(ctx.run_dir),
    }


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def build_table(results: dict, temperature: str) -> dict:
    """Per contender: tau per dataset and domain (95 % intervals beside), macro tau, latency,
    parameters, training."""
    table = {}
    for name, res in results.items():
        cells = {d: by_t[temperature] for d, by_t in res["report"]["results"].items()}
        table[name] = {
            "tau": {d: c["tau"] for d, c in cells.items()},
            "tau_interval": {d: c.get("tau_interval") for d, c in cells.items()},
            "domains": res["report"]["domains"][temperature],
            "domain_intervals": res["report"].get("domain_intervals", {}).get(temperature, {}),
            "draft_ms_per_round": mean([c["draft_ms_per_round"] for c in cells.values()]),
            "verify_ms_per_round": mean([c["verify_ms_per_round"] for c in cells.values()]),
            # mean over the benchmarks that reached position k (None: none did)
            "conditional_acceptance": [mean(m) if (m := [v for v in col if v is not None]) else None
                                       for col in zip(*[c["conditional_acceptance"]
                                                        for c in cells.values()])],
            "rounds": sum(c["rounds"] for c in cells.values()),
            "trainable_parameters": res["report"]["trainable_parameters"],
            "train_steps": res["train"]["steps"],
            "final_train_metrics": res["train"].get("final_metrics", {}),
        }
    return table


def comparisons(results: dict, temperature: str) -> dict:
    """The first contender against each other one: :func:`pipeline.tau_intervals.
    paired_difference` of the macro tau over the same prompts (``{"dspark / eagle3": {...}}``);
    empty where a report carries no per-prompt counts (one written before intervals existed)."""
    names = list(results)
    cells = {n: domain_cells(results[n]["report"]["results"], temperature) for n in names}
    if any(not c or not all(c.values()) for c in cells.values()):
        return {}
    domains = domain_of(cells[names[0]])
    out = {}
    for other in names[1:]:
        try:
            out[f"{names[0]} / {other}"] = paired_difference(cells[names[0]], cells[other], domains)
        except ValueError as err:  # evals of other prompts: no pairing, the tables still stand
            logging.getLogger(__name__).warning("no paired comparison with %s: %s", other, err)
    return out


def render_md(table: dict, results: dict, meta: dict) -> str:
    names = list(table)
    datasets = list(table[names[0]]["tau"])
    # every contender's domains (a domain where one drafted in no round is missing from its own)
    domains = list(dict.fromkeys(d for t in table.values() for d in t["domains"] if d != "macro"))
    lines = [
        "# Drafter quality: DSpark vs DFlash vs Eagle3 (same data, steps and prompts)", "",
        f"Target: `{meta['target']}` ({meta['dtype']}), gamma = {meta['gamma']}, temperature "
        f"{meta['temperature']}, {meta['prompts_per_dataset']} prompts per benchmark, "
        f"{meta['max_new_tokens']} new tokens, {meta['train_steps']} optimizer steps of "
        f"{meta['global_batch_size']} sequences for each drafter. Machine: {meta['machine']}. "
        f"Total wall time {meta['wall_minutes']:.1f} min. Command: `{meta['command']}`.", "",
    ]
    if meta.get("reused"):
        lines += ["Taken from an earlier run of this benchmark (`--results-from`, same settings; "
                  "its drafters trained on that run's regeneration of the same data): " +
                  ", ".join(f"{n} (`{f}`)" for n, f in meta["reused"].items()) + ".", ""]
    if meta.get("unfinished"):
        lines += [f"**Partial**: still to run: {', '.join(meta['unfinished'])}.", ""]
    lines += [
        "## Accepted length tau (bonus token included), paper Table 1 layout", "",
        "| drafter | " + " | ".join(datasets) + " | " + " | ".join(domains) + " | macro |",
        "|---|" + "---|" * (len(datasets) + len(domains) + 1),
    ]
    for n in names:
        t = table[n]
        lines.append(f"| {n} | " + " | ".join(format_interval(t["tau"][d], None, 3)
                                              for d in datasets) + " | " +
                     " | ".join(format_interval(t["domains"].get(d), None, 3) for d in domains) +
                     f" | {format_interval(t['domains'].get('macro'), None, 3)} |")
    lines += ["", f"The same taus with 95 % intervals ({INTERVAL_METHOD}):", "",
              "| drafter | " + " | ".join(domains) + " | macro |",
              "|---|" + "---|" * (len(domains) + 1)]
    for n in names:
        t, ci = table[n], table[n].get("domain_intervals", {})
        lines.append(f"| {n} | " + " | ".join(format_interval(t["domains"].get(d), ci.get(d))
                                               for d in domains) +
                     f" | {format_interval(t['domains'].get('macro'), ci.get('macro'))} |")
    lines += ["", "## DSpark's tau relative to the baselines", "",
              "| ratio | " + " | ".join(domains) + " | macro |", "|---|" + "---|" * (len(domains) + 1)]
    ref = names[0]  # the first contender (dspark by default)
    def ratio(a: float | None, b: float | None) -> str:  # "-" where either side is unmeasured
        return "-" if a is None or not b else f"{a / b:.3f}"

    for base in names[1:]:
        mine, theirs = table[ref]["domains"], table[base]["domains"]
        lines.append(f"| {ref} / {base} | " + " | ".join(
            ratio(mine.get(d), theirs.get(d)) for d in domains) +
            f" | {ratio(mine.get('macro'), theirs.get('macro'))} |")
    paired = meta.get("comparisons") or {}
    if paired:
        lines += ["", "Paired on the same prompts and seeds (macro tau; 'separates': the 95 % "
                  "interval of the difference excludes 0; half-width: the smallest difference "
                  "this eval resolves, relative to the second drafter's macro tau):", "",
                  "| pair | macro difference [95 %] | ratio [95 %] | half-width | separates |",
                  "|---|---|---|---|---|"]
        for pair, c in paired.items():
            ratio = "-" if c["ratio"] is None else format_interval(c["ratio"], c["ratio_interval"], 3)
            rel = c["relative_half_width"]
            lines.append(f"| {pair} | {format_interval(c['difference'], c['difference_interval'], 3)}"
                         f" | {ratio} | {c['half_width']:.3f}"
                         f"{'' if rel is None else f' ({rel:.1%})'} | "
                         f"{'yes' if c['separates'] else 'no'} |")
    lines += ["", "## Cost", "",
              "| drafter | trainable parameters | draft ms/round | verify ms/round | rounds | "
              "final train loss | final held-out tau (probabilistic) |",
              "|---|---|---|---|---|---|---|"]
    for n in names:
        t, fm = table[n], table[n]["final_train_metrics"]
        lines.append(f"| {n} | {t['trainable_parameters'] / 1e6:.1f} M | "
                     f"{format_interval(t['draft_ms_per_round'], None, 1)} | "
                     f"{format_interval(t['verify_ms_per_round'], None, 1)} | "
                     f"{t['rounds']} | {fm.get('loss', float('nan')):.3f} | "
                     f"{fm.get('heldout_tau', float('nan')):.3f} |")
    lines += ["", "Conditional acceptance per position (mean over benchmarks), "
              f"`{meta['files']['conditional_acceptance']}`:", "",
              "| drafter | " + " | ".join(f"k={k + 1}" for k in range(meta["gamma"])) + " |",
              "|---|" + "---|" * meta["gamma"]]
    for n in names:  # a contender with a shorter block has no rate past it: '-'
        rates = list(table[n]["conditional_acceptance"])[:meta["gamma"]]
        rates += [None] * (meta["gamma"] - len(rates))
        lines.append(f"| {n} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in rates)
                     + " |")
    cal = results[ref]["calibration"]
    lines += ["", f"## {ref} calibration (STS on held-out prompts)", ""]
    if cal.get("calibrated"):
        lines += [f"Temperatures fitted on {cal['fit_rounds']} full-block rounds of half the held-out "
                  f"prompts, reported on the other half ({cal['report_rounds']} rounds)"
                  + (f"; reliability diagram: `{meta['files']['reliability']}`."
                     if meta["files"].get("reliability") else "."), "",
                  "| position | positive rate | ECE before | ECE after | AUROC | Brier before | Brier after |",
                  "|---|---|---|---|---|---|---|"]
        for p in cal["report"]["positions"]:
            auroc = "-" if p["auroc_before"] is None else f"{p['auroc_before']:.3f}"
            lines.append(f"| {p['position']} | {p['positive_rate']:.3f} | {p['ece_before']:.3f} | "
                         f"{p['ece_after']:.3f} | {auroc} | {p['brier_before']:.3f} | "
                         f"{p['brier_after']:.3f} |")
        lines.append(f"| mean | | {cal['mean_ece_before']:.3f} | {cal['mean_ece_after']:.3f} | | | |")
        lines.append("")
        lines.append("Temperatures: " + ", ".join(f"{t:.2f}" for t in cal["temperatures"]))
        if cal.get("unfitted_positions"):
            lines.append(f"(positions {cal['unfitted_positions']} kept 1: too few fit rounds "
                         "accepted that far to fit a temperature)")
    else:
        lines.append(f"Not calibrated: {cal.get('reason')}")
    return "\n".join(lines) + "\n"


def eval_settings(cfg) -> dict:
    """What must be equal for two contenders' taus to be compared on the same prompts and budget
    (kept in the results JSON, checked by ``--results-from``)."""
    return {"target": cfg.target.name_or_path, "temperature": str(cfg.eval.temperatures[-1]),
            "max_new_tokens": cfg.eval.max_new_tokens, "datasets": dict(cfg.eval.datasets),
            "scheduler": cfg.engine.scheduler, "train_max_steps": cfg.train.max_steps,
            "global_batch_size": cfg.train.global_batch_size}


def reusable_contenders(path: Path, names: list[str], cfg) -> dict:
    """The contenders of ``names`` that an earlier results JSON of this benchmark already holds,
    as :func:`run_contender` returns them (``run_dir`` None, ``from`` the file).

    Raises:
        ValueError: the file is unreadable, keeps no per-contender reports, or was measured with
            other eval or training settings (each differing field named).
    """
    try:
        earlier = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"not a readable results JSON ({err})") from err
    if "contenders" not in earlier or "settings" not in earlier.get("meta", {}):
        raise ValueError("written before contenders' reports were kept; run them again")
    ours, theirs = eval_settings(cfg), earlier["meta"]["settings"]
    differ = [f"{k}: {theirs.get(k)!r} there, {v!r} here" for k, v in ours.items()
              if theirs.get(k) != v]
    if differ:
        raise ValueError("measured with other settings (" + "; ".join(differ) + ")")
    return {n: {**earlier["contenders"][n], "run_dir": None, "from": str(path)}
            for n in names if n in earlier["contenders"]}


def write_outputs(results: dict, names: list[str], cfg, args, timings: dict, started: float,
                  reused: dict) -> str:
    """Writes the tables, plots and JSON of the contenders finished so far; returns the markdown."""
    temperature = str(cfg.eval.temperatures[-1])
    table = build_table(results, temperature)
    out = Path(args.out)  # the files' path without a suffix: plots beside it
    out.parent.mkdir(parents=True, exist_ok=True)
    from pipeline.plots import conditional_acceptance_plot, tau_bar_plot

    files = {"conditional_acceptance": f"{out.name}_conditional_acceptance.png",
             "tau": f"{out.name}_tau.png", "reliability": f"{out.name}_dspark_reliability.png"}
    conditional_acceptance_plot({n: t["conditional_acceptance"] for n, t in table.items()},
                                out.parent / files["conditional_acceptance"],
                                title="P(token k accepted | tokens < k accepted), mean over benchmarks")
    tau_bar_plot({n: t["tau"] for n, t in table.items()}, out.parent / files["tau"],
                 title=f"Accepted length tau at T = {temperature}")
    first = next(iter(results))
    reliability = (RunLayout(Path(results[first]["run_dir"])).reliability_plot
                   if results[first]["run_dir"] is not None else None)
    if reliability is not None and reliability.exists():
        (out.parent / files["reliability"]).write_bytes(reliability.read_bytes())
    elif not (out.parent / files["reliability"]).exists():
        # a contender reused from an earlier run (--results-from) brings no plot: name none
        files["reliability"] = None
    meta = {"comparisons": comparisons(results, temperature),
            "target": cfg.target.name_or_path, "dtype": resolve_dtype_name(cfg.eval.dtype),
            "gamma": cfg.drafter.block_size, "temperature": temperature,
            "prompts_per_dataset": max(cfg.eval.datasets.values()),
            "max_new_tokens": cfg.eval.max_new_tokens,
            "train_steps": table[first]["train_steps"],
            "global_batch_size": cfg.train.global_batch_size, "settings": eval_settings(cfg),
            "unfinished": [n for n in names if n not in results],
            "reused": {n: results[n]["from"] for n in reused},
            "machine": describe_machine(), "hardware": machine_fields(),
            "date": time.strftime("%Y-%m-%d", time.localtime(started)),  # as the file's name
            "wall_minutes": (time.time() - started) / 60, "timings_s": timings, "files": files,
            "command": "python benchmarks/drafter_quality.py " + " ".join(sys.argv[1:])}
    kept = {n: {k: r[k] for k in ("report", "calibration", "train")} for n, r in results.items()}
    Path(f"{out}.json").write_text(json.dumps(
        {"meta": meta, "table": table, "calibration": results[first]["calibration"],
         "contenders": kept}, indent=1))
    md = render_md(table, results, meta)
    Path(f"{out}.md").write_text(md)
    return md


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "infra/configs/drafter_quality.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--out", default=None, help=OUT_HELP + "; --suffix is its label")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS,
                        help=f"comma-separated, the first is the reference (one of "
                             f"{', '.join(CONTENDERS)})")
    parser.add_argument("--suffix", default="",
                        help="the run's label in its file names (e.g. _reference: "
                             "drafter_quality/<date>_<class>_reference.md)")
    parser.add_argument("--data-from", default=None, metavar="RUN_DIR",
                        help="link the prompts/generate/cache stages of this finished run (e.g. "
                             "runs/smollm2_reference) instead of generating them; its data "
                             "sections must match the config's")
    parser.add_argument("--trained-from", default=None, metavar="RUN_DIR",
                        help="link each contender's train and calibrate stages from "
                             "RUN_DIR/<contender> (an earlier drafter_quality run), so only the "
                             "eval stage runs, e.g. at another temperature; pair it with --set "
                             "run_dir=... so that run's eval results stay as they are (its "
                             "prompts/generate/cache are linked too: --data-from is not needed)")
    parser.add_argument("--results-from", default=None, metavar="RESULTS_JSON",
                        help="take the contenders this earlier results JSON of the benchmark "
                             "holds from it instead of running them again (it must have been "
                             "measured with the same eval and training settings); the outputs "
                             "pair them with the ones run now, e.g. to add a contender later")
    args = parser.parse_args()
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        print(f"--contenders: unknown {unknown}; known: {', '.join(CONTENDERS)}", file=sys.stderr)
        return 2
    try:
        args.out = args.out or str(result_stem("drafter_quality", args.suffix, make=False))
    except ValueError as err:
        print(f"--suffix: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:  # a bad config or --set is reported like pipeline/run.py does, before any work
        for name in names:
            contender_config(args.config, name, args.set)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    started = time.time()
    timings, results = {}, {}
    first_dir = None
    if args.data_from:
        first_dir = Path(args.data_from).resolve()
        if not RunLayout(first_dir).marker(CACHE).exists():
            print(f"--data-from {args.data_from}: no finished cache stage there", file=sys.stderr)
            return 1
    trained_from = Path(args.trained_from).resolve() if args.trained_from else None
    if trained_from is not None:
        missing = missing_trained_stages(trained_from, names)
        if missing:
            print(f"--trained-from {args.trained_from}: no finished {', '.join(missing)} there",
                  file=sys.stderr)
            return 1
        own = [n for n in names if Path(storage.resolve(
            contender_config(args.config, n, args.set).run_dir)).resolve() == trained_from / n]
        if own:  # its eval results and config.yaml would be overwritten
            print(f"--trained-from {args.trained_from}: that is this run's own directory; set "
                  "another one (--set run_dir=...)", file=sys.stderr)
            return 2
    cfg = load_config(args.config, args.set)
    reused = {}
    if args.results_from:
        try:
            reused = reusable_contenders(Path(args.results_from), names, cfg)
        except ValueError as err:
            print(f"--results-from {args.results_from}: {err}", file=sys.stderr)
            return 2
    md = ""
    for name in names:
        if name in reused:
            results[name] = reused[name]
            continue
        ccfg = contender_config(args.config, name, args.set)
        ctx_dir = Path(stages.StageContext.create(ccfg).run_dir)
        if trained_from is not None:  # the data and the drafter it was trained on
            link_stages(trained_from / name, ctx_dir, SHARED_STAGES + MODEL_STAGES)
        elif first_dir is None:
            first_dir = ctx_dir
        else:
            link_stages(first_dir, ctx_dir)
        results[name] = run_contender(ccfg, timings, name)
        # after every contender, so a run stopped later still leaves the finished ones (and a
        # later run takes them back with --results-from)
        md = write_outputs(results, names, cfg, args, timings, started, reused)
    if not md:  # every contender came from --results-from: the tables, put together again
        md = write_outputs(results, names, cfg, args, timings, started, reused)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
