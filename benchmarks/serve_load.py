"""Serving under load: the DSpark scheduler vs no speculation, fixed gamma and a static threshold.

For each verification policy the Ray Serve app (``serve/app.py``, the real HTTP path) is started
with the trained drafter and the real target, then a load generator on 127.0.0.1 keeps C
concurrent streaming chat requests in flight (C = 1, 2, 4, ... 64), each point bounded in time and
request count. Per point: aggregate tokens/s, mean per-user tokens/s (decode speed after the first
token), time to first token, and the mean verification budget per request per step (verified
draft tokens / rounds, from the engine's counters). Writes
``benchmarks/results/serve_load.{md,json}``, a Pareto plot (throughput vs per-user speed, paper
Figure 7) and a budget-vs-concurrency plot (Figure 8).

    .venv/bin/python benchmarks/serve_load.py --drafter runs/drafter_quality/dspark/calibrate/drafter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = {
    "none": {"scheduler": "none"},
    "fixed": {"scheduler": "fixed"},
    "static_threshold": {"scheduler": "static_threshold", "threshold": 0.5},
    "dspark": {"scheduler": "dspark"},
}
PROMPT_SETS = ("mt-bench", "gsm8k", "humaneval", "alpaca")


def load_prompts(data_dir: Path, per_set: int, seed: int) -> list[str]:
    from pipeline.evaluate import load_eval_prompts

    prompts = []
    for name in PROMPT_SETS:
        prompts += load_eval_prompts(data_dir / f"{name}.jsonl", per_set, seed)
    random.Random(seed).shuffle(prompts)
    return prompts


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int, seed: int):
    """Stream one chat completion; returns (ttft_s, total_s, completion_tokens, decode_s)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body, timeout=600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return first - start, end - start, tokens, end - first


async def run_point(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                    duration_s: float, max_requests: int) -> dict:
    """Keep ``concurrency`` requests in flight until ``duration_s`` or ``max_requests``."""
    import httpx

    results, counter = [], {"next": 0}
    start = time.perf_counter()

    async def worker(client):
        while time.perf_counter() - start < duration_s and counter["next"] < max_requests:
            i = counter["next"]
            counter["next"] += 1
            results.append(await one_request(client, url, model, prompts[i % len(prompts)],
                                             max_tokens, seed=i))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    per_user = [(r[2] - 1) / r[3] for r in results if r[2] > 1 and r[3] > 0]
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "completion_tokens": tokens, "throughput_tok_s": tokens / wall,
            "per_user_tok_s": statistics.mean(per_user) if per_user else 0.0,
            "ttft_s_mean": statistics.mean(r[0] for r in results),
            "ttft_s_p50": statistics.median(r[0] for r in results)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_policy(name: str, args, prompts: list[str], port: int) -> list[dict]:
    from ray import serve

    from serve.app import build_app

    engine = {"max_num_requests": max(args.concurrency), "max_waiting": max(args.concurrency),
              "max_batch_tokens": args.max_batch_tokens, **POLICIES[name]}
    app_args = {"target": args.target, "drafter": args.drafter if name != "none" else args.drafter,
                "dtype": args.dtype, "served_model_name": "bench", "num_threads": args.threads,
                "num_cpus": 1, "engine": engine}
    handle = serve.run(build_app(app_args), name=f"bench-{name}", route_prefix="/")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    asyncio.run(run_point(url, "bench", prompts, 2, args.max_tokens, 60, 2))  # warm-up
    points = []
    for c in args.concurrency:
        before = handle.engine_state.remote().result()["stats"]
        point = asyncio.run(run_point(url, "bench", prompts, c, args.max_tokens, args.duration_s,
                                      max(args.min_requests, 2 * c)))
        after = handle.engine_state.remote().result()["stats"]
        rounds = after["rounds"] - before["rounds"]
        point["mean_verification_budget"] = ((after["verified_tokens"] - before["verified_tokens"])
                                             / rounds if rounds else 0.0)
        point["tau"] = (after["committed_tokens"] - before["committed_tokens"]) / rounds if rounds else 0.0
        point["steps"] = after["steps"] - before["steps"]
        point["policy"] = name
        points.append(point)
        logging.info("%s C=%d: %.1f tok/s, %.2f tok/s/user, budget %.2f, TTFT %.2f s", name, c,
                     point["throughput_tok_s"], point["per_user_tok_s"],
                     point["mean_verification_budget"], point["ttft_s_mean"])
    serve.delete(f"bench-{name}")
    return points


def render_md(points: list[dict], meta: dict) -> str:
    lines = ["# Serving under load: verification policies side by side", "",
             f"Target `{meta['target']}` ({meta['dtype']}), drafter `{meta['drafter']}`; "
             f"{meta['max_tokens']} new tokens per request at temperature 1, prompts from "
             f"{', '.join(PROMPT_SETS)}; each point runs {meta['duration_s']} s or at least "
             f"{meta['min_requests']} requests. Machine: {meta['machine']}. Total "
             f"{meta['wall_minutes']:.1f} min. Command: `{meta['command']}`.", "",
             "| policy | concurrency | requests | throughput tok/s | per-user tok/s | TTFT mean s "
             "| verification budget / request / step | tau |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['policy']} | {p['concurrency']} | {p['requests']} | "
                     f"{p['throughput_tok_s']:.1f} | {p['per_user_tok_s']:.2f} | "
                     f"{p['ttft_s_mean']:.2f} | {p['mean_verification_budget']:.2f} | "
                     f"{p['tau']:.2f} |")
    by = {(p["policy"], p["concurrency"]): p for p in points}
    top, low = max(meta["concurrency"]), min(meta["concurrency"])
    best_base = max(by[(n, top)]["throughput_tok_s"] for n in ("none", "fixed"))
    lines += ["", "## Done-when checks", "",
              f"- Aggregate throughput at concurrency {top}: dspark "
              f"{by[('dspark', top)]['throughput_tok_s']:.1f} tok/s vs the better of none/fixed "
              f"{best_base:.1f} tok/s (ratio {by[('dspark', top)]['throughput_tok_s'] / best_base:.3f}).",
              f"- Per-user speed at concurrency {low}: dspark {by[('dspark', low)]['per_user_tok_s']:.2f} "
              f"vs fixed {by[('fixed', low)]['per_user_tok_s']:.2f} tok/s (ratio "
              f"{by[('dspark', low)]['per_user_tok_s'] / max(1e-9, by[('fixed', low)]['per_user_tok_s']):.3f})."]
    return "\n".join(lines) + "\n"


def plots(points: list[dict], out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    policies = list(dict.fromkeys(p["policy"] for p in points))
    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name in policies:
        ps = [p for p in points if p["policy"] == name]
        ax.plot([p["per_user_tok_s"] for p in ps], [p["throughput_tok_s"] for p in ps], "o-",
                label=name)
        for p in ps:
            ax.annotate(str(p["concurrency"]), (p["per_user_tok_s"], p["throughput_tok_s"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Throughput vs per-user speed (labels: concurrency)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "serve_load_pareto.png", dpi=120)
    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name in policies:
        ps = [p for p in points if p["policy"] == name]
        ax.plot([p["concurrency"] for p in ps], [p["mean_verification_budget"] for p in ps], "o-",
                label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("verified draft tokens / request / step")
    ax.set_title("Verification budget vs concurrency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "serve_load_budget.png", dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="~/.cache/dspark_ray/models/SmolLM2-135M-Instruct")
    parser.add_argument("--drafter", default="runs/drafter_quality/dspark/calibrate/drafter")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--duration-s", type=float, default=25.0)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--data-dir", default=str(ROOT / "infra" / "datasets" / "eval"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    started = time.time()
    prompts = load_prompts(Path(args.data_dir), 40, 0)
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    points = []
    try:
        for name in args.policies.split(","):
            points += run_policy(name, args, prompts, port)
    finally:
        serve.shutdown()
        ray.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": args.target, "drafter": args.drafter, "dtype": args.dtype,
            "max_tokens": args.max_tokens, "duration_s": args.duration_s,
            "min_requests": args.min_requests, "concurrency": args.concurrency,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU",
            "wall_minutes": (time.time() - started) / 60,
            "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:])}
    (out / "serve_load.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    plots(points, out)
    md = render_md(points, meta)
    (out / "serve_load.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
