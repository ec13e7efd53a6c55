"""Where a decode step's time goes at high concurrency: the DSpark policy against no speculation.

The engine (``serve.engine.builder``, the same one the Ray Serve app runs, no HTTP) is given B
requests (B = 64 by default) of the serve_load prompt mix at temperature 1 (``--temperature``);
after the prefills and a warm-up, S decode steps are timed per policy, the policies alternating R
times. Each timed span also runs under cProfile, whose cumulative times split a step into: the
target forward, the drafter (pending-context extension + block proposal), the goodput planner, the
verification-length scheduler, verification/commit (``_finish_round``) and the rest. Writes
``benchmarks/results/engine_step_profile/<date>_<machine class>.{md,json}``.

    .venv/bin/python benchmarks/engine_step_profile.py --drafter <run>/calibrate/drafter
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from drafters.precision import resolve_dtype_name  # noqa: E402
# as the CPU serve config sets it (infra/configs/serve_quickstart.yaml): bounded oneDNN kernel cache
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")

from benchmarks.serve_load import load_prompts, policy_engine  # noqa: E402

# (label, module file, function) whose cumulative time is the part; the step itself is STEP
# (serve.engine.core.SpecEngine.step). A name that no longer exists fails the run (LookupError)
# instead of reading as a part that costs nothing.
STEP = ("core.py", "step")
PARTS = [
    ("target forward", "target_runner.py", "forward_batch"),
    ("drafter (context + block)", "core.py", "_propose"),
    ("goodput planner", "step_plan.py", "plan"),
    ("length scheduler", "step_plan.py", "schedule"),
    ("target distributions", "verification.py", "target_distributions"),
    ("verify + commit", "core.py", "_verify_and_commit"),
    ("pending context append", "drafting.py", "add_pending"),
]


def cumulative(stats: pstats.Stats, filename: str, func: str) -> float:
    return sum(v[3] for (f, _, name), v in stats.stats.items()
               if name == func and f.endswith(filename))


def run_arm(models, scheduler: str, prompts: list[str], args) -> dict:
    """B requests admitted and prefilled, ``warmup`` steps, then ``steps`` timed steps. With
    ``request_tokens`` each request ends after that many tokens and a new one (the next prompt)
    takes its place before the next step, as under serving load (prefills, drafter contexts of
    new requests and their first plans fall inside the timed steps)."""
    from serve.engine.builder import build_engine
    from serve.engine.chat import render_prompt_ids
    from serve.engine.config import EngineConfig
    from serve.engine.requests import EngineRequest, SamplingParams

    engine = build_engine(models, EngineConfig(
        **policy_engine(scheduler), max_num_requests=args.batch, max_waiting=args.batch,
        kv_cache_memory_gib=1.0, max_model_len=1024),
        profile_dir=args.profile_dir or None)
    added = 0

    def add() -> None:
        nonlocal added
        text = prompts[added % len(prompts)]
        ids = render_prompt_ids(models.tokenizer, [{"role": "user", "content": text}],
                                {"enable_thinking": False})
        engine.add_request(EngineRequest(f"r{added}", ids[:256], SamplingParams(
            max_tokens=args.request_tokens or args.warmup + args.steps + 64,
            temperature=args.temperature,
            seed=added if args.seeded else None, ignore_eos=True)))
        added += 1

    def step() -> int:
        outs = engine.step()
        for o in outs:
            if o.finished and args.request_tokens:
                add()
        return sum(len(o.new_token_ids) for o in outs)

    for _ in range(args.batch):
        add()
    while engine.waiting or engine.prefilling:  # admit and prefill all
        step()
    for _ in range(args.warmup):
        step()
    prof = cProfile.Profile()
    tokens = 0
    start = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        tokens += step()
    prof.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(prof)
    step_total = cumulative(stats, *STEP)
    if not step_total:
        raise LookupError(f"no {STEP} in the profile: update STEP / PARTS")
    parts = {label: cumulative(stats, f, fn) / args.steps * 1e3 for label, f, fn in PARTS}
    return {"policy": scheduler, "ms_per_step": wall / args.steps * 1e3,
            "tokens_per_s": tokens / wall, "tokens_per_step": tokens / args.steps,
            "profiled_ms_per_step": step_total / args.steps * 1e3, "parts_ms": parts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(Path("~/.cache/dspark_ray/models/"
                                                 "SmolLM2-135M-Instruct").expanduser()))
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="none,dspark",
                    help="comma-separated serve_load policies or variants (dspark-probe_budget=0)")
    ap.add_argument("--temperature", type=float, default=1.0, help="every request's (0 = greedy)")
    ap.add_argument("--seeded", action=argparse.BooleanOptionalAction, default=True,
                    help="seeded requests (with a drafter they sample load-invariantly: a Gumbel "
                    "draw over the vocabulary per token); --no-seeded as serve_load's requests")
    ap.add_argument("--request-tokens", type=int, default=0, help="end each request after this "
                    "many tokens and admit the next prompt in its place (serving churn); 0 = "
                    "the same B requests throughout")
    ap.add_argument("--profile-dir", default="", help="SPS/drafter-cost profile directory "
                    "(default: the drafter's own)")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    args = ap.parse_args()
    args.out = args.out or str(result_stem("engine_step_profile"))
    import torch

    from serve.engine.builder import load_models

    policies = args.policies.split(",")
    for pol in policies:  # a bad name or variant fails here, before minutes of model loading
        policy_engine(pol)
    models = load_models(args.target, args.dtype, args.drafter)
    prompts = load_prompts(ROOT / "infra" / "datasets" / "eval", 16, 0)
    for pol in policies:  # untimed: first-use kernel creation must not land in either arm
        run_arm(models, pol, prompts, argparse.Namespace(**{**vars(args), "steps": 2,
                                                            "warmup": 1}))
    rows = []
    for rep in range(args.repeats):
        for pol in (policies if rep % 2 == 0 else policies[::-1]):  # arms alternate
            row = run_arm(models, pol, prompts, args)
            row["repeat"] = rep
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for pol in policies:
        mine = [r for r in rows if r["policy"] == pol]
        summary[pol] = {
            "ms_per_step": statistics.median(r["ms_per_step"] for r in mine),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in mine),
            "profiled_ms_per_step": statistics.median(r["profiled_ms_per_step"] for r in mine),
            "parts_ms": {label: statistics.median(r["parts_ms"][label] for r in mine)
                         for label, _, _ in PARTS}}
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": describe_machine(), "hardware": machine_fields(),
            "threads": torch.get_num_threads(), "target": args.target, "drafter": args.drafter,
            "dtype": resolve_dtype_name(args.dtype), "batch": args.batch, "steps": args.steps,
            "repeats": args.repeats, "request_tokens": args.request_tokens,
            "temperature": args.temperature, "seeded": args.seeded}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                    "rows": rows}, indent=1))
    base = summary[policies[0]]["tokens_per_s"]
    kind = "seeded" if args.seeded else "unseeded"
    lines = [f"# Engine step profile at {args.batch} requests, temperature "
             f"{args.temperature:g}, {kind} requests ({meta['date']}; {meta['machine']})", "",
             f"`{' '.join(sys.argv)}`; {args.steps} timed steps per arm after {args.warmup} "
             f"warm-up steps, {args.repeats} repeats, arms alternating; medians. Parts are "
             "cProfile cumulative times (profiling inflates Python-heavy parts alike in both "
             "arms); wall ms/step is the same span's wall clock.", "",
             "| policy | ms/step | tokens/step | tokens/s | vs " + policies[0] + " | "
             + " | ".join(label for label, _, _ in PARTS) + " | rest |",
             "|---" * (6 + len(PARTS)) + "|"]
    for pol, s in summary.items():
        rest = s["profiled_ms_per_step"] - sum(s["parts_ms"][l] for l, _, _ in PARTS
                                               if l != "pending context append")
        lines.append(f"| {pol} | {s['ms_per_step']:.1f} | {s['tokens_per_step']:.2f} | "
                     f"{s['tokens_per_s']:.1f} | {s['tokens_per_s'] / base:.3f} | "
                     + " | ".join(f"{s['parts_ms'][l]:.1f}" for l, _, _ in PARTS)
                     + f" | {rest:.1f} |")
    lines += ["", "(pending context append is part of verify + commit; rest = the step's "
              "profiled time minus the other parts.)", ""]
    Path(f"{out}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
