"""Soak test of the HTTP server as users run it (`serve run <config>`): many concurrent streams for
minutes, clients that disconnect mid-stream, malformed requests in between.

Starts ``serve run`` on a copy of the serve config (drafter path and engine capacity set from the
command line), keeps C streaming chat requests in flight for the given duration (a fifth of them
disconnect after a few chunks; one request in ten is malformed and must get a 4xx), and records
the HTTP status counts, engine restarts (the replica process changing or /health failing),
the replica's resident memory after a one-minute warm-up at full concurrency and at the end, and
whether every completed stream ended with a valid finish reason and usage. Writes ``benchmarks/results/serve_soak/<date>_<machine class>.{md,json}``.

    .venv/bin/python benchmarks/serve_soak.py --drafter runs/quickstart/calibrate/drafter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from benchmarks.processes import stop_session  # noqa: E402
from benchmarks.serve_load import sse_data  # noqa: E402

MODEL = "soak"

# (description, request body or raw bytes): each must be refused with a 4xx, never a 5xx
MALFORMED = [
    ("invalid JSON", b'{"model": "soak", "messages": [}'),
    ("no messages", {"model": MODEL}),
    ("unknown model", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    ("negative max_tokens", {"model": MODEL, "max_tokens": -3,
                             "messages": [{"role": "user", "content": "hi"}]}),
    ("temperature out of range", {"model": MODEL, "temperature": 7,
                                  "messages": [{"role": "user", "content": "hi"}]}),
    ("top_logprobs without logprobs", {"model": MODEL, "top_logprobs": 3,
                                       "messages": [{"role": "user", "content": "hi"}]}),
    ("unsupported n", {"model": MODEL, "n": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ("role typo", {"model": MODEL, "messages": [{"role": "usr", "content": "hi"}]}),
    ("stop token out of vocabulary", {"model": MODEL, "stop_token_ids": [10**9],
                                      "messages": [{"role": "user", "content": "hi"}]}),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def soak_config(base: Path, drafter: str | None, port: int, max_num_requests: int,
                max_waiting: int) -> Path:
    """A copy of the serve config with the soak's drafter, port and engine capacity."""
    cfg = yaml.safe_load(base.read_text())
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    if drafter is not None:
        app["args"]["drafter"] = drafter
    app["args"]["served_model_name"] = MODEL
    app["args"]["engine"].update({"max_num_requests": max_num_requests,
                                  "max_waiting": max_waiting})
    path = Path(tempfile.mkdtemp(prefix="serve_soak_")) / "serve_soak.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def replica() -> tuple[int, float] | None:
    """(pid, resident MB) of the serving replica process, or None."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith("ray::ServeReplica") and "SpecServer" in cmd:
            try:
                return p.pid, p.memory_info().rss / 2**20
            except psutil.Error:
                return None
    return None


class Tally:
    def __init__(self):
        self.status: dict[int, int] = {}
        self.requests = self.completed = self.disconnected = self.invalid = 0
        self.malformed_not_4xx: list[str] = []
        self.invalid_examples: list[str] = []
        self.tokens = 0

    def count(self, status: int) -> None:
        self.requests += 1
        self.status[status] = self.status.get(status, 0) + 1

    def by_class(self, klass: int) -> int:
        return sum(v for k, v in self.status.items() if k // 100 == klass)


async def stream_one(client, url: str, prompt: str, max_tokens: int, disconnect: bool,
                     tally: Tally, rng: random.Random) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": rng.choice([0.0, 1.0]),
            "seed": rng.randrange(10**6), "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body, timeout=900) as resp:
        tally.count(resp.status_code)
        if resp.status_code != 200:
            await resp.aread()
            return
        chunks, finish, usage = 0, None, None
        async for data in sse_data(resp):
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            chunks += 1
            if disconnect and chunks >= 3:
                tally.disconnected += 1
                return  # leaving the context closes the connection mid-stream
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    tally.completed += 1
    ok = (finish in ("stop", "length") and usage is not None
          and 0 < usage["completion_tokens"] <= max_tokens and usage["prompt_tokens"] > 0)
    if not ok:
        tally.invalid += 1
        if len(tally.invalid_examples) < 5:
            tally.invalid_examples.append(f"finish={finish!r} usage={usage!r}")
    else:
        tally.tokens += usage["completion_tokens"]


async def malformed_one(client, url: str, tally: Tally, rng: random.Random) -> None:
    name, body = rng.choice(MALFORMED)
    if isinstance(body, bytes):
        resp = await client.post(url, content=body, headers={"content-type": "application/json"})
    else:
        resp = await client.post(url, json=body)
    tally.count(resp.status_code)
    if resp.status_code // 100 != 4:
        tally.malformed_not_4xx.append(f"{name}: HTTP {resp.status_code}")


async def load(url: str, health: str, prompts: list[str], concurrency: int, duration_s: float,
               max_tokens: int, seed: int) -> tuple[Tally, dict]:
    import httpx

    tally, deadline = Tally(), time.time() + duration_s
    pids: set[int] = set()
    unhealthy = 0

    async def worker(i: int, client):
        rng = random.Random(seed * 1000 + i)
        while time.time() < deadline:
            try:
                if rng.random() < 0.1:
                    await malformed_one(client, url, tally, rng)
                else:
                    await stream_one(client, url, rng.choice(prompts), max_tokens,
                                     rng.random() < 0.2, tally, rng)
            except httpx.HTTPError as err:  # a transport failure is a server failure too
                tally.count(599)
                tally.malformed_not_4xx.append(f"transport: {type(err).__name__}")

    rss_mb: list[float] = []  # the replica's resident memory every 2 s (leak or plateau?)
    pool: dict = {}

    async def watch(client):
        nonlocal unhealthy, pool
        while time.time() < deadline:
            try:
                resp = await client.get(health)
                if resp.status_code != 200:
                    unhealthy += 1
                else:
                    pool = resp.json().get("kv_pool", {})
            except httpx.HTTPError:
                unhealthy += 1
            rep = replica()
            if rep:
                pids.add(rep[0])
                rss_mb.append(round(rep[1], 1))
            await asyncio.sleep(2)

    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=900) as client:
        await asyncio.gather(watch(client), *(worker(i, client) for i in range(concurrency)))
    return tally, {"replica_pids": sorted(pids), "failed_health_checks": unhealthy,
                   "rss_mb": rss_mb, "kv_pool": pool}


def wait_ready(health: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode}")
        try:
            if httpx.get(health, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(3)
    raise TimeoutError("the server did not become healthy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "infra" / "configs" /
                                                "serve_quickstart.yaml"))
    parser.add_argument("--drafter", default=None, help="override the config's drafter path")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=300)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-num-requests", type=int, default=32)
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help=OUT_HELP)
    args = parser.parse_args()
    args.out = args.out or str(result_stem("serve_soak"))
    sys.path.insert(0, str(ROOT))
    from pipeline.evaluate import load_eval_prompts

    data = ROOT / "infra" / "datasets" / "eval"
    prompts = [p for name in ("mt-bench", "gsm8k", "humaneval", "alpaca")
               for p in load_eval_prompts(data / f"{name}.jsonl", 20, args.seed)]
    port = free_port()
    config = soak_config(Path(args.config), args.drafter, port, args.max_num_requests,
                         args.max_waiting)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    serve_bin = Path(sys.executable).with_name("serve")
    log = open(config.with_suffix(".log"), "w")  # next to the temporary config
    proc = subprocess.Popen([str(serve_bin), "run", str(config)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    started = time.time()
    try:
        wait_ready(f"{base}/health", proc)
        # warm-up at full concurrency (profiles, allocator and KV pages touched by a full batch),
        # so that start and end memory compare like with like; then the soak proper
        asyncio.run(load(f"{base}/v1/chat/completions", f"{base}/health", prompts,
                         args.concurrency, 60, args.max_tokens, args.seed + 1))
        start_rep = replica()
        tally, watch = asyncio.run(load(f"{base}/v1/chat/completions", f"{base}/health", prompts,
                                        args.concurrency, args.duration_s, args.max_tokens,
                                        args.seed))
        time.sleep(5)  # let disconnected requests be aborted
        end_rep = replica()
    finally:
        stop_session(proc)
    pids = set(watch["replica_pids"]) | {r[0] for r in (start_rep, end_rep) if r}
    result = {
        "requests": tally.requests, "status_2xx": tally.by_class(2),
        "status_4xx": tally.by_class(4), "status_5xx": tally.by_class(5),
        "status_counts": {str(k): v for k, v in sorted(tally.status.items())},
        "completed_streams": tally.completed, "disconnected_streams": tally.disconnected,
        "completion_tokens": tally.tokens, "invalid_outputs": tally.invalid,
        "invalid_examples": tally.invalid_examples,
        "malformed_not_4xx": tally.malformed_not_4xx[:20],
        "engine_restarts": max(0, len(pids) - 1), "failed_health_checks":
            watch["failed_health_checks"],
        "rss_start_mb": round(start_rep[1], 1) if start_rep else None,
        "rss_end_mb": round(end_rep[1], 1) if end_rep else None,
        "rss_by_minute_mb": watch["rss_mb"][::30],
        "kv_pool": watch["kv_pool"],
        "meta": {"config": str(Path(args.config).relative_to(ROOT)), "drafter": args.drafter,
                 "concurrency": args.concurrency, "duration_s": args.duration_s,
                 "max_tokens": args.max_tokens, "max_num_requests": args.max_num_requests,
                 "max_waiting": args.max_waiting,
                 "machine": describe_machine(), "hardware": machine_fields(),
                 "date": time.strftime("%Y-%m-%d"),
                 "wall_s": round(time.time() - started),
                 "command": "python benchmarks/serve_soak.py " + " ".join(sys.argv[1:])},
    }
    growth = (None if not (start_rep and end_rep)
              else 100 * (end_rep[1] - start_rep[1]) / start_rep[1])
    result["rss_growth_pct"] = None if growth is None else round(growth, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    m = result["meta"]
    md = [
        "# Serving soak (measured)", "",
        f"`serve run {m['config']}` (drafter `{m['drafter']}`, engine max_num_requests "
        f"{m['max_num_requests']}, max_waiting {m['max_waiting']}); {m['concurrency']} concurrent "
        f"clients for {m['duration_s']:.0f} s, streaming chat at max_tokens {m['max_tokens']}, "
        "temperature 0 or 1; a fifth of the streams disconnect after 3 chunks; one request in ten "
        f"is malformed ({len(MALFORMED)} kinds, each must get a 4xx). {m['machine']}, "
        f"{m['date']}. Command: `{m['command']}`.", "",
        "| requests | 2xx | 4xx | 5xx | completed streams | disconnected | invalid outputs | "
        "engine restarts | failed health checks | RSS start MB | RSS end MB | growth |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {result['requests']} | {result['status_2xx']} | {result['status_4xx']} | "
        f"{result['status_5xx']} | {result['completed_streams']} | "
        f"{result['disconnected_streams']} | {result['invalid_outputs']} | "
        f"{result['engine_restarts']} | {result['failed_health_checks']} | "
        f"{result['rss_start_mb']} | {result['rss_end_mb']} | {result['rss_growth_pct']} % |", "",
        f"Status codes: {result['status_counts']}. Completion tokens streamed: "
        f"{result['completion_tokens']}.",
    ]
    md.append(f"Replica RSS each minute (MB): {result['rss_by_minute_mb']}. Target KV pool at the "
              f"end: {result['kv_pool']}.")
    if result["malformed_not_4xx"]:
        md.append(f"Requests that should have been a 4xx: {result['malformed_not_4xx']}.")
    if result["invalid_examples"]:
        md.append(f"Invalid outputs (first ones): {result['invalid_examples']}.")
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
