"""Held-out learning curve of the drafter: accept_rate@1 and tau against optimizer steps.

Trains the configured drafter on a finished run's cache (its prompts/generate/cache stages are
reused; a pipeline run that stopped after ``cache`` is enough) for ``--steps`` optimizer steps with
held-out metrics every ``--eval-every`` steps, through the pipeline's own train stage (Ray Train +
DeepSpeed), then plots the curve. The metrics are the trainer's probabilistic ones on held-out
cache rows (accept_rate@k = mean prod_{i<=k}(1 - TV_i); tau = 1 + sum_k accept_rate@k per block).
Writes ``benchmarks/results/learning_curve/<date>_<machine class>.{json,png,md}``.

    .venv/bin/python benchmarks/learning_curve.py --config infra/configs/quickstart.yaml --steps 600
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from pipeline import stages  # noqa: E402
from pipeline.config import ConfigError, load_config  # noqa: E402
from pipeline.run_layout import CACHE, TRAIN, link_stages  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "infra" / "configs" / "quickstart.yaml"))
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-rows", type=int, default=16)
    parser.add_argument("--label", default="learning_curve")
    parser.add_argument("--out", default=None, help=OUT_HELP + "; --label is its label")
    args = parser.parse_args()
    try:  # the label is part of a file name: checked before the training, not after it
        result_stem("learning_curve", args.label, make=False)
    except ValueError as err:
        print(f"error: --label: {err}", file=sys.stderr)
        return 2
    try:
        # a curve from the target's layers (the quickstart itself fine-tunes the shipped drafter)
        scratch = ["train.init_from=null", *args.set]
        base = load_config(args.config, scratch)
        cfg = load_config(args.config, scratch + [
            f"train.max_steps={args.steps}", "train.num_epochs=1000",
            f"train.eval_every={args.eval_every}", f"train.eval_rows={args.eval_rows}",
            f"train.checkpoint_every={args.steps}"])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    src = stages.StageContext.create(base)
    if not src.layout.marker(CACHE).exists():
        print(f"error: no finished cache stage under {src.run_dir}: run the pipeline's data stages "
              "first (pipeline/run.py --stages prompts,generate,cache)", file=sys.stderr)
        return 1
    cfg.run_dir = str(Path(base.run_dir).with_name(Path(base.run_dir).name + "_" + args.label))
    ctx = stages.StageContext.create(cfg)
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    link_stages(src.run_dir, ctx.run_dir)  # share the data stages
    shutil.rmtree(ctx.layout.stage_dir(TRAIN), ignore_errors=True)
    start = time.time()
    stages.run_stage(ctx, TRAIN)
    seconds = time.time() - start
    log = [json.loads(l) for l in
           ctx.layout.training_log.read_text().splitlines()]
    points = [{"step": e["step"], "heldout_accept_rate@1": e["heldout_accept_rate@1"],
               "heldout_tau": e["heldout_tau"], "train_accept_rate@1": e["accept_rate@1"],
               "train_tau": e["tau"], "heldout_loss": e["heldout_loss"]}
              for e in log if "heldout_tau" in e]
    out = Path(args.out or result_stem(  # the files' path without a suffix
        "learning_curve", "" if args.label == "learning_curve" else args.label))
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"config": args.config, "set": args.set, "steps": args.steps,
            "train_seconds": round(seconds, 1), "seconds_per_step": round(seconds / args.steps, 3),
            "date": time.strftime("%Y-%m-%d"), "drafter": cfg.drafter.model_dump(),
            "train": {k: v for k, v in cfg.train.model_dump().items()
                      if k in ("lr", "global_batch_size", "num_anchors", "warmup_ratio")}}
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [p["step"] for p in points]
    a1.plot(steps, [p["heldout_accept_rate@1"] for p in points], label="held-out")
    a1.plot(steps, [p["train_accept_rate@1"] for p in points], label="train (that step)", alpha=0.5)
    a1.set_xlabel("optimizer step")
    a1.set_ylabel("accept_rate@1")
    a1.legend()
    a2.plot(steps, [p["heldout_tau"] for p in points], label="held-out")
    a2.plot(steps, [p["train_tau"] for p in points], label="train (that step)", alpha=0.5)
    a2.set_xlabel("optimizer step")
    a2.set_ylabel("tau (probabilistic)")
    a2.legend()
    fig.suptitle(f"{cfg.drafter.drafter_type} drafter learning curve ({seconds / 60:.1f} min)")
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=110)
    lines = [f"# Learning curve ({args.label}, measured {meta['date']})", "",
             f"{args.steps} optimizer steps in {seconds:.0f} s ({meta['seconds_per_step']} s/step); "
             f"settings {json.dumps(meta['train'])}; drafter {json.dumps(meta['drafter'])}.", "",
             "| step | held-out accept_rate@1 | held-out tau | train accept_rate@1 | train tau |",
             "|---|---|---|---|---|"]
    lines += [f"| {p['step']} | {p['heldout_accept_rate@1']:.3f} | {p['heldout_tau']:.3f} | "
              f"{p['train_accept_rate@1']:.3f} | {p['train_tau']:.3f} |" for p in points]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
