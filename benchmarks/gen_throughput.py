"""Generate-stage throughput: the hf backend (padded batches, transformers forward) against the
engine backend (this project's continuous-batching engine, target only), on the same prompts and
sampling, arms alternating.

Each arm is the actor class the generate stage runs (``pipeline.generate.hf.GenerateUDF``,
``pipeline.generate.engine.EngineGenerateUDF``), constructed once (model loading is not timed)
and called in-process, as a Ray Data actor calls it: the hf arm on batches of ``batch_size``
prompts sorted by length (as ``run_generate`` orders them), the engine arm on all prompts at once
with ``max_num_requests`` in flight. Generated tokens are the sampled answer tokens (end token
included), counted by the arms themselves. Prompts: ``--prompts`` rows of the config's training
prompts (its sources, seed and split), spread over the domains. Writes
``benchmarks/results/gen_throughput/<date>_<machine class>.{md,json}``.

    .venv/bin/python benchmarks/gen_throughput.py --config infra/configs/smollm2_reference.yaml \
        --prompts 256 --hf-batch-sizes 32,64 --engine-batch-sizes 64,128 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from drafters.precision import resolve_dtype_name  # noqa: E402

from pipeline import storage  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.prompts import load_prompts  # noqa: E402


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def pick_prompts(cfg, n: int) -> list[dict]:
    """``n`` training prompts of the config, the same share of each domain as the config has."""
    p = cfg.prompts
    split = load_prompts([(storage.resolve(s.path), s.max_rows) for s in p.sources],
                         p.heldout_fraction, p.seed, cfg.storage_options)
    rows = list(split.train)
    random.Random(0).shuffle(rows)
    return rows[:n]


def as_batch(rows: list[dict]) -> dict:
    import numpy as np

    return {"id": np.array([r["id"] for r in rows]),
            "domain": np.array([r["domain"] for r in rows]),
            "messages": np.array([json.dumps(r["messages"], ensure_ascii=False) for r in rows])}


def build_arm(name: str, size: int, cfg, target: str, max_new_tokens: int):
    from pipeline.generate.hf import GenerateUDF
    from pipeline.generate.engine import EngineGenerateUDF

    g = cfg.generate
    sampling = dict(g.sampling.model_dump(), max_new_tokens=max_new_tokens)
    common = dict(target=target, dtype=cfg.target.dtype, sampling=sampling,
                  template_kwargs=cfg.target.chat_template_kwargs, num_threads=g.num_threads,
                  max_prompt_tokens=g.max_prompt_tokens, seed=cfg.seed)
    if name == "hf":
        return GenerateUDF(**common)
    # engine_pytorch: the engine with PyTorch attention only (serve.engine.config: attention)
    return EngineGenerateUDF(**common, max_num_requests=size,
                             kv_cache_memory_gib=g.kv_cache_memory_gib,
                             attention="pytorch" if name == "engine_pytorch" else "kernel")


def run_arm(name: str, size: int, udf, rows: list[dict]) -> dict:
    """Generate answers for ``rows``; returns seconds, generated tokens, rows, errors."""
    if name == "hf":  # the stage's order: similar prompt lengths share a padded batch
        rows = sorted(rows, key=lambda r: sum(len(m["content"]) for m in r["messages"]))
        batches = [rows[i:i + size] for i in range(0, len(rows), size)]
    else:
        batches = [rows]
    before = udf.generated_tokens
    errors = 0
    t0 = time.perf_counter()
    for b in batches:
        out = udf(as_batch(b))  # the engine backend yields its rows in chunks
        for chunk in ([out] if isinstance(out, dict) else out):
            errors += sum(1 for e in chunk["error"] if e)
    seconds = time.perf_counter() - t0
    tokens = udf.generated_tokens - before
    return {"arm": f"{name}@{size}", "backend": name, "batch": size, "seconds": seconds,
            "tokens": tokens, "rows": len(rows), "errors": errors, "tokens_per_s": tokens / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="infra/configs/smollm2_reference.yaml")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="default: the config's generate.sampling.max_new_tokens")
    ap.add_argument("--hf-batch-sizes", type=int_list, default=[32, 64])
    ap.add_argument("--engine-batch-sizes", type=int_list, default=[64, 128])
    ap.add_argument("--engine-pytorch-batch-sizes", type=int_list, default=[],
                    help="also the engine with PyTorch attention only (engine.attention: "
                    "pytorch) at these batch sizes")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help=OUT_HELP)
    args = ap.parse_args()
    args.out = args.out or str(result_stem("gen_throughput"))
    if not args.hf_batch_sizes or any(b < 1 for b in args.hf_batch_sizes + args.engine_batch_sizes
                                                + args.engine_pytorch_batch_sizes):
        ap.error("--hf-batch-sizes needs at least one size (the baseline) and every size >= 1")

    from pipeline.stages import StageContext

    cfg = load_config(args.config)
    target = StageContext.create(cfg).target  # the packaged target materialised, as a run does
    max_new = args.max_new_tokens or cfg.generate.sampling.max_new_tokens
    rows = pick_prompts(cfg, args.prompts)
    arms = ([("hf", b) for b in args.hf_batch_sizes]
            + [("engine", b) for b in args.engine_batch_sizes]
            + [("engine_pytorch", b) for b in args.engine_pytorch_batch_sizes])
    udfs = {arm: build_arm(arm[0], arm[1], cfg, target, max_new) for arm in arms}
    results = []
    for rep in range(args.repeats):
        order = arms[rep % len(arms):] + arms[:rep % len(arms)]  # a different arm first each time
        for arm in order:
            row = dict(run_arm(arm[0], arm[1], udfs[arm], rows), repeat=rep)
            results.append(row)
            print(json.dumps(row), flush=True)
    summary = []
    for name, size in arms:
        mine = [r for r in results if r["arm"] == f"{name}@{size}"]
        summary.append({"arm": f"{name}@{size}", "backend": name, "batch": size,
                        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                        "per_repeat": [round(r["tokens_per_s"], 1) for r in mine],
                        "tokens_per_row": statistics.mean(r["tokens"] / r["rows"] for r in mine),
                        "errors": sum(r["errors"] for r in mine)})
    base = max(s["tokens_per_s"] for s in summary if s["backend"] == "hf")
    for s in summary:
        s["vs_best_hf"] = s["tokens_per_s"] / base
    meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
            "config": args.config, "prompts": len(rows), "max_new_tokens": max_new,
            "sampling": cfg.generate.sampling.model_dump(), "dtype": resolve_dtype_name(cfg.target.dtype),
            "num_threads": cfg.generate.num_threads, "repeats": args.repeats,
            "machine": describe_machine(), "hardware": machine_fields(),
            "domains": {d: sum(r["domain"] == d for r in rows)
                        for d in sorted({r["domain"] for r in rows})}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                    "runs": results}, indent=1))
    lines = [f"# Generate-stage throughput ({meta['date']})", "",
             f"`{meta['command']}`: {len(rows)} training prompts ({meta['domains']}), "
             f"sampling {meta['sampling']} with max_new_tokens {max_new}, {cfg.target.dtype}, "
             f"{cfg.generate.num_threads} torch threads, {meta['machine']}; arms alternating, "
             f"{args.repeats} repeats, medians. Model loading is not timed.", "",
             "| arm | generated tokens/s | vs best hf | per repeat | tokens per answer | errors |",
             "|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['arm']} | {s['tokens_per_s']:.1f} | {s['vs_best_hf']:.2f}x | "
                     f"{', '.join(map(str, s['per_repeat']))} | {s['tokens_per_row']:.1f} | "
                     f"{s['errors']} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
