"""Speculative decoding against what users already have, end to end, in one run.

Arms (batch 1, the same rendered prompts, max_new_tokens 128 by default), alternating prompt by
prompt (prompt i starts at arm i mod n) so machine drift hits every arm alike:

- ``hf_generate_fp32`` / ``hf_generate_bf16``: plain transformers ``generate``; the faster of the
  two per (dataset, temperature) is the baseline every ``speedup_vs_generate`` is taken against;
- ``engine_target_only``: this project's engine without a drafter;
- ``dspark``: the calibrated DSpark drafter with the dspark scheduler (Algorithm 1 over SPS(B))
  and the goodput planner (drafts only where its profiled cost pays, ``serve/engine/draft_planner.py``);
- ``dspark_lookup``: the same, with prompt-lookup drafts as a second, free source the planner
  picks per request and round (``engine.prompt_lookup_max_ngram``);
- ``dspark_unfilled``: ``dspark`` planning and verifying on the measured SPS(B) as it is
  (``engine.fill_passes: false``: no upper envelope, no filled passes);
- ``dspark_unplanned``: the dspark scheduler drafting gamma tokens every round (no planner);
- ``dspark_fixed``: the same drafter verifying fixed gamma-token blocks;
- ``eagle3``: an Eagle3 drafter trained on the same data and steps, fixed gamma (``--eagle3 DIR``,
  or ``--eagle3 train``: train it now on the run's cache with the config's train section, in
  ``<run_dir>_eagle3``);
- ``prompt_lookup``: transformers prompt-lookup decoding (``prompt_lookup_num_tokens``).

Greedy and temperature 1 (T = 1 reports tokens/s; tau and acceptance are the engine's round
records). Afterwards every non-plain arm decodes the greedy prompts again in fp32 and is compared
token by token with plain fp32 ``generate``: ``identical_to_target`` is the share of prompts whose
outputs match. Writes ``benchmarks/results/spec_vs_target/<date>_<machine class>.{md,json}`` (one JSON row per arm,
dataset and temperature).

    .venv/bin/python benchmarks/spec_vs_target.py --config infra/configs/quickstart.yaml \
        [--eagle3 runs/quickstart_eagle3/train/drafter] [--datasets gsm8k=20,mt-bench=10,humaneval=10]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402

from pipeline import storage  # noqa: E402
from pipeline.config import ConfigError, load_config  # noqa: E402
from pipeline.evaluate import load_eval_prompts  # noqa: E402
from pipeline.stages import StageContext  # noqa: E402
from pipeline.run_layout import CALIBRATE, TRAIN, link_stages  # noqa: E402

PLAIN = ("hf_generate_fp32", "hf_generate_bf16")
PROMPT_LOOKUP_TOKENS = 10
LOOKUP_NGRAM = 3  # the engine's lookup source: n-grams of 3 down to 2 tokens


def parse_datasets(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if not name or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--datasets wants name=count[,name=count...], got {text!r}")
        out[name.strip()] = int(count)
    return out


class Arms:
    """Loads the target (fp32 and the benchmark dtype), the drafters and one engine per arm."""

    def __init__(self, target: str, dtype: str, drafter_dir: str, eagle3_dir: str | None,
                 max_batch_tokens: int, only: list[str] | None = None):
        import torch

        from drafters.loading import load_drafter
        from serve.engine.builder import build_engine, load_models
        from serve.engine.config import EngineConfig

        self.dtype = dtype
        self.models = {}
        self.engines: dict[str, dict] = {}
        for d in ("float32", "bfloat16"):
            # the fp32 engines serve the identity check only: their profiles are not stored
            m = self.models[d] = load_models(target, d, drafter_dir if d in (dtype, "float32")
                                             else None)
            if m.drafter is None:
                continue
            self.gamma = m.drafter.config.block_size
            # one request at a time, seeded for paired arms: rejection sampling, as unseeded
            # production requests get it (serve.engine.config.EngineConfig.seeded_sampling)
            one = dict(max_num_requests=1, max_batch_tokens=max_batch_tokens,
                       seeded_sampling="rejection")
            configs = {
                "engine_target_only": EngineConfig(scheduler="none", **one),
                "dspark": EngineConfig(scheduler="dspark", **one),
                "dspark_lookup": EngineConfig(scheduler="dspark", prompt_lookup_max_ngram=LOOKUP_NGRAM,
                                              **one),
                "dspark_unfilled": EngineConfig(scheduler="dspark", fill_passes=False, **one),
                "dspark_unplanned": EngineConfig(scheduler="dspark", draft_planning="off", **one),
                "dspark_fixed": EngineConfig(scheduler="fixed", **one),
            }
            where = None if d == dtype else ""
            engines = {name: build_engine(m, cfg, profile_dir=where)
                       for name, cfg in configs.items()}
            if eagle3_dir:
                eagle3 = load_drafter(eagle3_dir, m.model, target, dtype=m.model.dtype)
                if list(eagle3.config.target_layer_ids) != m.runner.layer_ids:
                    raise ValueError(f"{eagle3_dir} reads target layers "
                                     f"{eagle3.config.target_layer_ids}, the DSpark drafter "
                                     f"{m.runner.layer_ids}")
                engines["eagle3"] = build_engine(m, EngineConfig(scheduler="fixed", **one),
                                                 drafter=eagle3, profile_dir="")
            self.engines[d] = engines
        self.tokenizer = self.models[dtype].tokenizer
        pad = self.tokenizer.pad_token_id
        self.eos, self.pad = self.models[dtype].eos, pad if pad is not None else 0
        self.names = [a for a in list(PLAIN) + list(self.engines[dtype]) + ["prompt_lookup"]
                      if not only or a in only]
        torch.set_grad_enabled(False)

    def run(self, arm: str, ids: list[int], max_new: int, temperature: float, seed: int,
            dtype: str | None = None) -> dict:
        from pipeline.baselines import hf_generate
        from serve.engine.requests import EngineRequest, SamplingParams

        dtype = dtype or self.dtype
        if arm in PLAIN or arm == "prompt_lookup":
            model = self.models["float32" if arm == "hf_generate_fp32" else
                                "bfloat16" if arm == "hf_generate_bf16" else dtype].model
            out = hf_generate(model, ids, max_new, temperature, seed, self.eos, self.pad,
                              PROMPT_LOOKUP_TOKENS if arm == "prompt_lookup" else 0)
            return {"tokens": out.tokens, "seconds": out.seconds, "rounds": []}
        engine = self.engines[dtype][arm]
        req = EngineRequest(f"bench-{arm}", list(ids),
                            SamplingParams(max_tokens=max_new, temperature=temperature, seed=seed))
        done = engine.generate([req])[0]
        return {"tokens": done.tokens, "seconds": done.total_s, "rounds": done.rounds}


def train_eagle3(config: str, overrides: list[str]) -> str:
    """Train an Eagle3 drafter on the finished run's data stages (shared by symlink) with the
    same train section, in ``<run_dir>_eagle3``; returns its drafter directory."""
    from pipeline import stages

    base = StageContext.create(load_config(config, overrides))
    cfg = load_config(config, overrides + ["drafter.drafter_type=eagle3", "drafter.head_type=none",
                                           "drafter.confidence_head=false", "drafter.init=random"])
    cfg.run_dir = str(base.run_dir) + "_eagle3"
    ctx = StageContext.create(cfg)
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    link_stages(base.run_dir, ctx.run_dir)
    stages.run_stage(ctx, TRAIN)
    return str(ctx.layout.drafter(TRAIN))


def summarize(results: list[dict], gamma: int) -> dict:
    """Tokens/s over all prompts of a cell, and the engine's round statistics over the rounds
    that verified at least one draft token (``serve.engine.metrics.SpecDecodeStats`` definitions)."""
    from serve.engine.metrics import SpecDecodeStats

    tokens = sum(len(r["tokens"]) for r in results)
    seconds = sum(r["seconds"] for r in results)
    rounds = [rd for r in results for rd in r["rounds"] if rd.verified > 0]
    row = {"prompts": len(results), "tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": tokens / seconds if seconds else 0.0}
    all_rounds = [rd for r in results for rd in r["rounds"]]
    if rounds:
        from pipeline.tau_intervals import prompt_counts, tau_interval

        stats = SpecDecodeStats()
        for rd in rounds:
            stats.record_round(rd.drafted, rd.verified, rd.accepted, rd.committed)
        row.update({
            "tau": stats.tau, "verified_per_round": stats.mean_verification_budget(),
            # 95 %, bootstrap over prompts (pipeline/tau_intervals.py)
            "tau_interval": tau_interval(prompt_counts([r["rounds"] for r in results])),
            # accept_rate@k: rounds that verified >= k draft tokens and accepted the first k
            "accept_rate": stats.accept_rate_at_k(),
            "draft_ms_per_round": 1e3 * statistics.fmean(rd.draft_s for rd in all_rounds),
            "verify_ms_per_round": 1e3 * statistics.fmean(rd.verify_s for rd in all_rounds),
            "rounds": len(rounds), "steps": len(all_rounds),
            # where the drafts came from: share of steps the drafter ran / a lookup draft was used
            "drafter_step_share": sum(rd.source == "model" for rd in all_rounds) / len(all_rounds),
            "lookup_step_share": sum(rd.source == "lookup" for rd in all_rounds) / len(all_rounds)})
    return row


# where an engine step's time goes: (label, module path suffix, function name) of cProfile entries
STEP_PARTS = (
    ("target forward", "target_runner.py", "forward_batch"),
    ("drafter: block + sampling", "dspark.py", "propose_block"),
    ("drafter: batched block", "dspark.py", "propose_block_batch"),
    ("drafter: extend context", "dspark.py", "extend_context_batch"),
    ("eagle3: extend context", "base.py", "extend_context_batch"),
    ("eagle3 drafting", "eagle3.py", "propose_block"),
    ("target distributions", "verification.py", "target_distributions"),
    ("verification + commit", "core.py", "_verify_and_commit"),
)
STEP = ("core.py", "step")  # serve.engine.core.SpecEngine.step: the whole engine step


def profile_steps(arms: Arms, arm: str, ids: list[int], max_new: int) -> dict:
    """cProfile one decode of ``arm`` and split its time into the engine step's parts
    (cumulative seconds per part; "other" is the rest of the steps: Python bookkeeping).

    Raises:
        LookupError: the profile has no engine step (``STEP`` names a moved function)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    out = arms.run(arm, ids, max_new, 0.0, 0)
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = next((v[3] for k, v in stats.items() if k[0].endswith(STEP[0]) and k[2] == STEP[1]),
                 None)
    if total is None:
        raise LookupError(f"no {STEP} in the profile of {arm}: update STEP / STEP_PARTS")
    parts = {}
    for label, path, func in STEP_PARTS:
        t = sum(v[3] for k, v in stats.items() if k[0].endswith(path) and k[2] == func)
        if t:
            parts[label] = t
    parts["other (Python bookkeeping)"] = max(0.0, total - sum(parts.values()))
    steps = max(1, len(out["rounds"]))
    return {"arm": arm, "steps": steps, "step_ms": 1e3 * total / steps,
            "parts_ms_per_step": {k: 1e3 * v / steps for k, v in parts.items()}}


def render(rows: list[dict], meta: dict) -> str:
    from pipeline.tau_intervals import format_interval

    lines = [
        "# Speculative decoding vs plain `generate` (measured)", "",
        f"Target `{meta['target']}`, arms in {meta['dtype']} (plain generate in fp32 and bf16), "
        f"batch 1, max_new_tokens {meta['max_new_tokens']}, {meta['threads']} threads, "
        f"{meta['date']}, {meta['seconds']:.0f} s, {meta.get('machine', 'machine not recorded')}. "
        f"speed-up = tokens/s / tokens/s of the faster "
        "plain `generate` on the same prompts. tau = committed tokens per round that verified drafts "
        "(bonus included), [its 95 % interval, bootstrap over prompts]; accept_rate@k = share of "
        "rounds verifying >= k drafts that accepted the first k; draft / verify ms = per engine step (all steps); drafter / lookup steps = share "
        "of steps in which the drafter ran / a prompt-lookup draft was verified; identical = "
        "share of prompts whose fp32 greedy output equals plain fp32 `generate` token for token "
        f"(first {meta['identity_max_new_tokens']} tokens). "
        + ("" if meta["fp32_sampled"] else "Plain fp32 `generate` is timed at greedy only; at "
           "T = 1 the baseline is bf16 `generate`."),
        "", "| dataset | T | arm | tok/s | speed-up | tau | verified/round | accept_rate@1..k "
        "| draft / verify ms | drafter / lookup steps | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " / ".join("-" if a is None else f"{a:.2f}" for a in r.get("accept_rate") or [])
        dv = (f"{r['draft_ms_per_round']:.1f} / {r['verify_ms_per_round']:.1f}"
              if "draft_ms_per_round" in r else "")
        same = r.get("identical_to_target")
        src = (f"{r['drafter_step_share']:.0%} / {r['lookup_step_share']:.0%}"
               if "drafter_step_share" in r else "")
        lines.append(
            f"| {r['dataset']} | {r['temperature']:g} | {r['arm']} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup_vs_generate']:.2f}x | "
            f"{format_interval(r['tau'], r.get('tau_interval')) if 'tau' in r else '-'} | "
            f"{r.get('verified_per_round', float('nan')):.2f} | {acc} | {dv} | {src} | "
            f"{'' if same is None else f'{same:.0%}'} |".replace("nan", "-"))
    for prof in meta.get("profile", []):
        lines += ["", f"Where one engine step goes ({prof['arm']}, greedy, cProfile, "
                  f"{prof['steps']} steps, {prof['step_ms']:.1f} ms per step with the profiler "
                  "on):", "", "| part | ms / step | share |", "|---|---|---|"]
        for part, ms in prof["parts_ms_per_step"].items():
            lines.append(f"| {part} | {ms:.1f} | {ms / prof['step_ms']:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "infra" / "configs" / "quickstart.yaml"))
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--drafter", default=None,
                        help="DSpark drafter directory (default: <run_dir>/calibrate/drafter)")
    parser.add_argument("--eagle3", default=None,
                        help="Eagle3 drafter directory, or 'train' (optional arm)")
    parser.add_argument("--datasets", default="gsm8k=20,mt-bench=10,humaneval=10")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="the speculative arms' dtype (auto: bf16 where native, else fp32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch-tokens", type=int, default=64)
    parser.add_argument("--no-identity", action="store_true",
                        help="skip the fp32 greedy token-identity pass")
    parser.add_argument("--identity-max-new-tokens", type=int, default=None,
                        help="tokens compared per prompt in the identity pass (default: all)")
    parser.add_argument("--fp32-sampled", action="store_true",
                        help="also time plain fp32 generate at temperature > 0")
    parser.add_argument("--arms", default=None, help="comma-separated subset of the arms "
                        "(default: all; hf_generate_bf16 or _fp32 is needed as the baseline)")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    args = parser.parse_args()
    args.out = args.out or str(result_stem("spec_vs_target"))
    from drafters.precision import resolve_dtype_name

    args.dtype = resolve_dtype_name(args.dtype)
    try:
        cfg = load_config(args.config, args.set)
        datasets = parse_datasets(args.datasets)
        temperatures = [float(t) for t in args.temperatures.split(",")]
        only = args.arms.split(",") if args.arms else None
        if only and not set(only) & set(PLAIN):
            raise ValueError(f"--arms {args.arms!r} needs a plain generate arm as the baseline: "
                             f"one of {PLAIN}")
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from serve.engine.chat import render_prompt_ids

    torch.set_num_threads(args.threads)
    ctx = StageContext.create(cfg)
    drafter = args.drafter or str(ctx.layout.drafter(CALIBRATE))
    if args.eagle3 == "train":
        args.eagle3 = train_eagle3(args.config, args.set)
    for path in filter(None, (drafter, args.eagle3)):
        if not (Path(storage.resolve(path)) / "config.json").is_file():
            print(f"error: no drafter at {path}: run the pipeline first", file=sys.stderr)
            return 1
    data_dir = Path(storage.resolve(cfg.eval.data_dir))
    prompts = {n: load_eval_prompts(data_dir / f"{n}.jsonl", c, cfg.eval.shuffle_seed)
               for n, c in datasets.items()}
    start = time.time()
    arms = Arms(ctx.target, args.dtype, storage.resolve(drafter),
                args.eagle3 and storage.resolve(args.eagle3), args.max_batch_tokens, only)
    tmpl = cfg.target.chat_template_kwargs
    rendered = {n: [render_prompt_ids(arms.tokenizer, [{"role": "user", "content": p}], tmpl)
                    for p in ps] for n, ps in prompts.items()}
    # warm-up: one short decode per arm (first-call allocations, SPS profile already done)
    for arm in arms.names:
        arms.run(arm, rendered[next(iter(rendered))][0], 8, 0.0, 0)
    results: dict[tuple, list] = {}
    for temp in temperatures:
        for name, items in rendered.items():
            for i, ids in enumerate(items):
                order = arms.names[i % len(arms.names):] + arms.names[:i % len(arms.names)]
                for arm in order:
                    if arm == "hf_generate_fp32" and temp > 0 and not args.fp32_sampled:
                        continue  # slower than bf16 here at greedy (see the table); saves time
                    results.setdefault((arm, name, temp), []).append(
                        arms.run(arm, ids, args.max_new_tokens, temp, cfg.seed + i))
                print(f"T={temp:g} {name} {i + 1}/{len(items)}", flush=True)
    identical: dict[tuple, float] = {}
    if not args.no_identity and 0.0 in temperatures and "hf_generate_fp32" in arms.names:
        ref_arm = "hf_generate_fp32"
        for name, items in rendered.items():
            refs = [r["tokens"] for r in results[(ref_arm, name, 0.0)]]
            for arm in arms.names:
                if arm in PLAIN:
                    continue
                n = args.identity_max_new_tokens or args.max_new_tokens
                same = [arms.run(arm, ids, n, 0.0, cfg.seed + i,
                                 dtype="float32")["tokens"] == refs[i][:n]
                        for i, ids in enumerate(items)]
                identical[(arm, name)] = sum(same) / len(same)
            identical[(ref_arm, name)] = 1.0
            print(f"fp32 identity {name}: " + ", ".join(
                f"{a} {identical[(a, name)]:.0%}" for a in arms.names if (a, name) in identical),
                flush=True)
    rows = []
    for temp in temperatures:
        for name in rendered:
            cells = {arm: summarize(results[(arm, name, temp)], arms.gamma) for arm in arms.names
                     if (arm, name, temp) in results}
            base = max(cells[a]["tokens_per_s"] for a in PLAIN if a in cells)
            for arm, cell in cells.items():
                row = {"arm": arm, "dataset": name, "temperature": temp, **cell,
                       "speedup_vs_generate": cell["tokens_per_s"] / base if base else 0.0}
                if temp == 0.0 and (arm, name) in identical:
                    row["identical_to_target"] = identical[(arm, name)]
                rows.append(row)
    meta = {"profile": [], "identity_max_new_tokens": args.identity_max_new_tokens
            or args.max_new_tokens, "fp32_sampled": args.fp32_sampled,
            "target": ctx.target, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "threads": args.threads, "drafter": drafter, "eagle3": args.eagle3,
            "datasets": datasets, "date": time.strftime("%Y-%m-%d"),
            "seconds": time.time() - start, "platform": platform.platform(),
            "machine": describe_machine(), "hardware": machine_fields()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> str:
        Path(f"{out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        md = render(rows, meta)
        Path(f"{out}.md").write_text(md)
        return md

    write()  # the measurements are kept whatever the profile below does
    first = rendered[next(iter(rendered))][0]
    try:
        meta["profile"] = [profile_steps(arms, arm, first, args.max_new_tokens)
                           for arm in ("engine_target_only", "dspark") if arm in arms.names]
    except LookupError as err:
        print(f"warning: step profile skipped: {err}", file=sys.stderr)
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
