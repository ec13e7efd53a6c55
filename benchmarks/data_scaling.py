"""Data scaling of the drafter: held-out accept_rate@1, tau and tau per domain against the
supervised tokens it trained on, each point trained to its own plateau on the same held-out rows.

The points are nested subsets of one finished run's cache (``train.max_train_rows``: whole shards
in a seeded order, so each smaller set is inside every larger one; ``all`` = the whole cache).
Each is trained by the pipeline's own train stage (Ray Train + DeepSpeed) in
``<run_dir>_scaling_<rows>`` (the data stages linked, not copied) with held-out evaluations every
``--eval-every`` steps, stopping at the plateau (``train.plateau_patience``) or ``--max-steps``;
a point whose drafter exists is reused, and an interrupted one resumes from its newest
checkpoint. The ``all`` point is the base run's own train stage (trained to its plateau under the
config's own ``eval_every`` and plateau rule; run or resumed here when it has not finished, so do
not run this while ``pipeline/run.py`` trains the same run). The held-out metrics are the trainer's probabilistic ones (accept_rate@k = mean
prod_{i<=k}(1 - TV_i), tau = 1 + sum_k accept_rate@k per block), at the best evaluation; per
domain they are computed afterwards with the same loss code on every held-out cache row of the
domain. Writes ``benchmarks/results/data_scaling/<date>_<machine class>.{json,md,png}``.

    .venv/bin/python benchmarks/data_scaling.py --config infra/configs/smollm2_reference.yaml \
        --points 240,960,3840,all [--also-runs infra/configs/smollm2_reference_xl.yaml]

``--also-runs`` adds further points past the whole cache: other configs' own runs on the same
held-out prompts (checked), each its own train stage like the ``all`` point.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from pipeline import stages  # noqa: E402
from pipeline.config import ConfigError, load_config  # noqa: E402
from pipeline.run_layout import CACHE, TRAIN, RunLayout, link_stages  # noqa: E402


def parse_points(text: str) -> list[int | None]:
    """"240,960,all" -> [240, 960, None] (None: the whole cache)."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise ValueError(f"--points wants row counts or 'all', got {part!r}")
    return out


def domain_metrics(ctx, drafter_dir: Path, rows_per_batch: int = 8) -> dict:
    """Held-out accept_rate@1 and tau per domain (and over all held-out rows) of a trained
    drafter, with the trainer's loss code on every held-out cache row, in the row's own
    anchor-sampling RNG (``row_generator(seed, -1, row)``, as the trainer's evaluations use)."""
    import torch

    from drafters.loading import load_drafter
    from pipeline.cache.format import read_manifest
    from pipeline.prompts import read_jsonl
    from pipeline.train.worker import batch_losses, reduce_metrics
    from pipeline.train.data import CacheRowIndex, CacheRowReader, row_generator
    from serve.engine.target_loading import load_target

    cfg = ctx.cfg
    manifest = read_manifest(ctx.cache_dir, cfg.storage_options)
    target = load_target(ctx.target, "float32")
    drafter = load_drafter(drafter_dir, target, ctx.target).eval()
    domain_of = {r["id"]: r["domain"]
                 for r in read_jsonl(str(ctx.layout.prompts("heldout")))}
    index = CacheRowIndex(ctx.cache_dir, manifest, "heldout", cfg.storage_options)
    reader = CacheRowReader(index, manifest["target"]["hidden_size"], len(ctx.layer_ids))
    tc = cfg.train
    objective, weights = drafter.config.spec.training_objective(drafter.config, tc.objective)
    by_domain: dict[str, list] = {}
    with torch.no_grad():
        for start in range(0, index.num_rows, rows_per_batch):
            rows = list(range(start, min(start + rows_per_batch, index.num_rows)))
            for row, sample in zip(rows, reader.read(rows)):
                out = batch_losses(drafter, [sample], tc, objective, weights,
                                   torch.device("cpu"), [row_generator(tc.seed, -1, row)])
                by_domain.setdefault(domain_of.get(sample["sample_id"], "unknown"), []).append(out)
    reader.close()
    k = cfg.drafter.block_size
    result = {d: reduce_metrics(outs, k) for d, outs in sorted(by_domain.items())}
    result["all"] = reduce_metrics([o for outs in by_domain.values() for o in outs], k)
    return {d: {"accept_rate@1": m["accept_rate@1"], "tau": m["tau"],
                "rows": len(by_domain.get(d, [])) if d != "all" else index.num_rows}
            for d, m in result.items()}


def check_base_run(base, sets: list[str]) -> None:
    """The base run's train stage can be the ``all`` point only as its config defines it.

    Raises:
        ValueError: a ``--set train.*`` override (it would change the base run's fingerprint: a
            finished stage would be refused, an unfinished one would train under a config that
            ``pipeline/run.py`` later refuses), or a config without held-out evaluations
            (``train.eval_every`` unset: no curve to read the point from).
    """
    if any(s.split("=", 1)[0].strip().startswith("train.") for s in sets):
        raise ValueError("--set train.* would change the base run's own train stage: pass "
                         "--no-all-from-run to train the 'all' point apart")
    if not base.train.eval_every:
        raise ValueError("the base config sets no train.eval_every (no held-out evaluations): "
                         "pass --no-all-from-run")


def check_same_heldout(base_run: Path, other_run: Path) -> None:
    """A run added with ``--also-runs`` is a point of this curve only on the same held-out
    prompts (e.g. ``prompts.heldout_ids_from`` naming the base run's held-out rows) and, where
    both runs have generated, the same held-out answers (``generate.reuse_from``).

    Raises:
        FileNotFoundError: either run has no prompts stage yet.
        ValueError: the held-out prompt ids differ (how many on each side), or a held-out
            prompt's answer differs.
    """
    from pipeline.prompts import read_ids, read_jsonl

    files = [RunLayout(Path(run)).prompts("heldout") for run in (base_run, other_run)]
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{f}: no prompts stage there yet")
    base, other = (read_ids(str(f)) for f in files)
    if base != other:
        raise ValueError(f"{other_run} holds out other prompts than {base_run} ({len(other - base)} "
                         f"not in the base run's, {len(base - other)} missing): its tau is not a "
                         "point of this curve")
    answers = [RunLayout(Path(run)).generated("heldout") for run in (base_run, other_run)]
    if all(a.exists() for a in answers):  # the held-out cache rows are these answers
        base_rows, other_rows = ({r["id"]: r["messages"] for r in read_jsonl(str(a))}
                                 for a in answers)
        differ = sorted(i for i in base_rows.keys() & other_rows.keys()
                        if base_rows[i] != other_rows[i])
        if differ:
            raise ValueError(f"{other_run} answers {len(differ)} held-out prompt(s) differently "
                             f"from {base_run} (e.g. {differ[:3]}): its held-out rows differ")


def train_point(base_cfg_path: str, sets: list[str], rows: int | None, args,
                label: str | None = None) -> dict:
    """Train (or reuse) one point; returns its row, token and metric summary. The ``all`` point
    is the base run's own train stage unless ``--no-all-from-run``; ``label`` names an
    ``--also-runs`` point (another config's own train stage, ``rows`` None)."""
    from pipeline.cache.format import read_manifest
    from pipeline.train.data import subset_manifest

    own_run = label is not None or (rows is None and args.all_from_run)  # a run's own stage
    label = label or ("all" if rows is None else str(rows))
    overrides = sets + [f"train.max_steps={args.max_steps}", "train.num_epochs=100000",
                        f"train.eval_every={args.eval_every}",
                        f"train.checkpoint_every={args.eval_every}",
                        f"train.plateau_patience={args.patience}",
                        f"train.plateau_min_delta={args.min_delta}",
                        "train.resume_from=latest"]
    if rows is not None:
        overrides.append(f"train.max_train_rows={rows}")
    base = load_config(base_cfg_path, sets)
    cfg = load_config(base_cfg_path, overrides)
    src = stages.StageContext.create(base)
    if not src.layout.marker(CACHE).exists():
        raise FileNotFoundError(f"no finished cache stage under {src.run_dir}: run the pipeline's "
                                "data stages first (pipeline/run.py --stages prompts,generate,cache)")
    if own_run:
        # the whole cache is what the base run itself trains on, to its own plateau: its train
        # stage is this point (run or resumed here), not a second training of hours
        check_base_run(base, sets)
        cfg, ctx = base, src
    else:
        cfg.run_dir = str(Path(base.run_dir).with_name(
            f"{Path(base.run_dir).name}_scaling_{label}"))
        ctx = stages.StageContext.create(cfg)
        link_stages(src.run_dir, ctx.run_dir)  # share the data stages
    start = time.time()
    summary = stages.run_stage(ctx, TRAIN)
    seconds = time.time() - start
    drafter_dir = ctx.layout.drafter(TRAIN)
    log = [json.loads(line) for line in ctx.layout.training_log.read_text().splitlines()]
    evals = [e for e in log if "heldout_tau" in e]
    best = max(evals, key=lambda e: e["heldout_tau"])
    manifest = subset_manifest(read_manifest(ctx.cache_dir, cfg.storage_options),
                               cfg.train.max_train_rows, cfg.seed)
    train_split = manifest["splits"]["train"]
    return {"label": label, "rows": train_split["rows"],
            "supervised_tokens": train_split["supervised_tokens"], "tokens": train_split["tokens"],
            "steps": log[-1]["step"], "plateau": bool(log[-1].get("plateau")),
            "train_seconds_this_run": round(seconds, 1), "summary_steps": summary.get("steps"),
            "best_step": best["step"], "heldout_accept_rate@1": best["heldout_accept_rate@1"],
            "heldout_tau": best["heldout_tau"],
            "final_heldout_tau": evals[-1]["heldout_tau"],
            "curve": [{"step": e["step"], "heldout_tau": e["heldout_tau"],
                       "heldout_accept_rate@1": e["heldout_accept_rate@1"]} for e in evals],
            "by_domain": domain_metrics(ctx, drafter_dir)}


def all_point_note(meta: dict) -> str:
    """What the markdown says of the 'all' point when it is the base run's own train stage."""
    also = ("" if not meta.get("also_runs") else
            f" Points named after a config ({', '.join(meta['also_runs'])}) are that config's own "
            "run on the same held-out prompts, trained by its own train stage and rule.")
    if not meta.get("all_from_run"):
        return also
    t = meta["base_train"]
    return (f" The 'all' point is the base run's own train stage: held-out evaluations every "
            f"{t['eval_every']} steps, plateau after {t['plateau_patience']} of them rising "
            f"less than {t['plateau_min_delta']}, at most {t['max_steps']} steps." + also)


def write_results(points: list[dict], meta: dict, out: Path) -> None:
    """``<out>.json``, ``<out>.png`` and ``<out>.md`` for the points so far (``out``: the files'
    path without a suffix; the md keeps the readings written below its table)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [p["supervised_tokens"] for p in points]
    a1.plot(xs, [p["heldout_accept_rate@1"] for p in points], marker="o")
    a1.set(xscale="log", xlabel="supervised training tokens", ylabel="held-out accept_rate@1")
    a2.plot(xs, [p["heldout_tau"] for p in points], marker="o", label="all held-out")
    domains = sorted({d for p in points for d in p["by_domain"] if d != "all"})
    for d in domains:
        a2.plot(xs, [p["by_domain"].get(d, {}).get("tau", float("nan")) for p in points],
                marker=".", linestyle="--", label=d)
    a2.set(xscale="log", xlabel="supervised training tokens", ylabel="held-out tau (gamma = "
           f"{meta['block_size']})")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.suptitle("Drafter data scaling (each point at its own plateau)")
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=110)
    lines = [f"# Data scaling ({meta['date']})", "", f"`{meta['command']}`", "",
             "Held-out metrics at each point's best evaluation (the trainer's probabilistic "
             "accept_rate@1 and tau on the same held-out cache rows); per domain: every held-out "
             "row of the domain, final weights. 'plateau': training stopped because held-out tau "
             f"rose less than {meta['min_delta']} over {meta['patience']} evaluations "
             f"(every {meta['eval_every']} steps); otherwise it ran to --max-steps "
             f"{meta['max_steps']}." + all_point_note(meta), "",
             "| point | train rows | supervised tokens | steps | plateau | best step | "
             "accept_rate@1 | tau | " + " | ".join(f"tau {d}" for d in domains) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(domains)]
    for p in points:
        lines.append(f"| {p['label']} | {p['rows']} | {p['supervised_tokens']:,} | {p['steps']} | "
                     f"{'yes' if p['plateau'] else 'no'} | {p['best_step']} | "
                     f"{p['heldout_accept_rate@1']:.3f} | {p['heldout_tau']:.3f} | " +
                     " | ".join(f"{p['by_domain'].get(d, {}).get('tau', float('nan')):.3f}"
                                for d in domains) + " |")
    md = Path(f"{out}.md")
    # the readings written by hand below the table survive the rewrite after every point
    readings = kept_readings(md.read_text()) if md.exists() else ""
    md.write_text("\n".join(lines) + "\n" + readings)
    print("\n".join(lines))


def kept_readings(markdown: str) -> str:
    """The part of a results file from its first ``## Reading`` heading on ("" if none), with
    one blank line before it."""
    at = markdown.find("\n## Reading")
    return "" if at < 0 else "\n" + markdown[at + 1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "infra" / "configs" / "smollm2_reference.yaml"))
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--points", type=parse_points, default=parse_points("240,960,3840,all"))
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--patience", type=int, default=4)
    ap.add_argument("--min-delta", type=float, default=0.01)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--all-from-run", action=argparse.BooleanOptionalAction, default=True,
                    help="the 'all' point is the base run's own train stage (its config's eval "
                         "cadence and plateau rule), run or resumed here; --no-all-from-run "
                         "trains it again like the other points")
    ap.add_argument("--also-runs", default="", metavar="CONFIG[,CONFIG]",
                    help="further points: each config's own finished (or resumed here) run, "
                         "e.g. infra/configs/smollm2_reference_xl.yaml, on the same held-out "
                         "prompts as --config's run (checked); labelled by the config's name")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    args = ap.parse_args()
    args.out = args.out or str(result_stem("data_scaling"))
    also = [c.strip() for c in args.also_runs.split(",") if c.strip()]
    try:
        cfg = load_config(args.config, args.set)
        also_cfgs = [load_config(c) for c in also]
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:  # before hours of training the base points
        base_dir = stages.StageContext.create(cfg).run_dir
        for other in also_cfgs:
            check_base_run(other, [])
            check_same_heldout(base_dir, stages.StageContext.create(other).run_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: --also-runs: {err}", file=sys.stderr)
        return 2
    meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
            "config": args.config, "set": args.set, "eval_every": args.eval_every,
            "patience": args.patience, "min_delta": args.min_delta, "max_steps": args.max_steps,
            "all_from_run": args.all_from_run, "also_runs": [Path(c).stem for c in also],
            # the 'all' point's own cadence and stopping rule when it is the base run's stage
            "base_train": {k: v for k, v in cfg.train.model_dump().items()
                           if k in ("eval_every", "plateau_patience", "plateau_min_delta",
                                    "max_steps", "resume_from")},
            "block_size": cfg.drafter.block_size, "drafter": cfg.drafter.model_dump(),
            "train": {k: v for k, v in cfg.train.model_dump().items()
                      if k in ("lr", "global_batch_size", "num_anchors", "warmup_ratio")}}
    points = []
    runs = [(args.config, args.set, rows, None) for rows in args.points]
    runs += [(c, [], None, Path(c).stem) for c in also]
    labels = [label for *_, label in runs if label]
    if len(set(labels)) < len(labels):
        print(f"error: --also-runs: two configs share a name ({labels})", file=sys.stderr)
        return 2
    for config, sets, rows, label in runs:
        try:
            points.append(train_point(config, sets, rows, args, label))
        except (FileNotFoundError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(json.dumps({k: v for k, v in points[-1].items() if k != "curve"}), flush=True)
        write_results(points, meta, Path(args.out))  # partial results survive a later failure
    return 0


if __name__ == "__main__":
    sys.exit(main())
