"""Speculative decoding vs the target alone, measured side by side in one run.

Re-evaluates the drafter of a finished pipeline run (default: the quickstart) on the configured
benchmarks and writes ``benchmarks/results/spec_vs_target.{md,json}``. Target-only and speculative
decoding alternate prompt by prompt, so machine noise hits both alike; the speed-up is their ratio.

    .venv/bin/python benchmarks/spec_vs_target.py --config infra/configs/quickstart.yaml \
        [--set eval.datasets="{gsm8k: 50}"]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import storage  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.evaluate import evaluate, load_eval_prompts, render_report_md  # noqa: E402
from pipeline.stages import StageContext  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "infra" / "configs" / "quickstart.yaml"))
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_vs_target"))
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    ctx = StageContext.create(cfg)
    drafter = ctx.run_dir / "calibrate" / "drafter"  # the calibrated checkpoint the pipeline ships
    if not drafter.exists():
        print(f"no calibrated drafter at {drafter}: run the pipeline first", file=sys.stderr)
        return 1
    e = cfg.eval
    data_dir = Path(storage.resolve(e.data_dir))
    datasets = {n: load_eval_prompts(data_dir / f"{n}.jsonl", c, e.shuffle_seed)
                for n, c in e.datasets.items()}
    start = time.time()
    report = evaluate(target=ctx.target, dtype=e.dtype, drafter_dir=str(drafter),
                      template_kwargs=cfg.target.chat_template_kwargs, datasets=datasets,
                      temperatures=e.temperatures, max_new_tokens=e.max_new_tokens,
                      num_threads=e.num_threads, seed=cfg.seed)
    report["machine"] = {"platform": platform.platform(), "processor": platform.processor(),
                         "threads": e.num_threads, "seconds": round(time.time() - start, 1),
                         "date": time.strftime("%Y-%m-%d")}
    md = render_report_md(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(md + f"\nMachine: {report['machine']}\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
