"""What serving through HTTP costs one user: per-user decode speed of the same requests through the
server's routes in-process (no HTTP, no Ray: the engine, the SSE chunks), through Ray Serve's
HTTP proxy (``serve run``, the default), and through Ray Serve's direct ingress
(``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``: the replica listens on the port itself, no proxy
process), one stream at a time, the arms alternating over ``--rounds``.

Per arm: mean per-user tokens/s (each request's completion tokens after the first over the time
from its first to its last chunk, as ``benchmarks/serve_load.py`` counts it), its ratio to the
in-process arm, and the mean time to the first chunk.

    .venv/bin/python benchmarks/http_tax.py [--drafter DIR] [--scheduler none] [--rounds 3]

Writes ``benchmarks/results/http_tax/<date>_<machine class>.{md,json}``. Needs a quiet machine (Ray's processes, the
client and the engine share its cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from drafters.precision import resolve_dtype_name  # noqa: E402

from benchmarks.processes import stop_session  # noqa: E402 - after the path insert

ARMS = ("in_process", "serve_proxy", "serve_direct_ingress")


def app_args(args) -> dict:
    return {"target": args.target, "drafter": args.drafter,
            "dtype": resolve_dtype_name(args.dtype),
            "served_model_name": "bench", "chat_template_kwargs": {"enable_thinking": False},
            "num_threads": args.threads, "num_cpus": 1, "default_max_tokens": args.max_tokens,
            "engine": {"scheduler": args.scheduler, "max_num_requests": 4, "max_waiting": 16,
                       "max_batch_tokens": 32, "kv_cache_memory_gib": 1,
                       "sps_profile": "auto" if args.drafter else "off"}}


def prompts(n: int) -> list[str]:
    from benchmarks.serve_load import load_prompts

    return load_prompts(ROOT / "infra" / "datasets" / "eval", n, 0)[:n]


def request_body(prompt: str, args) -> dict:
    return {"model": "bench", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}


class ChunkClock:
    """Times one streamed chat completion from its server-sent event lines: the first and last
    chunk with content, and the completion tokens of the final usage chunk."""

    def __init__(self, start: float):
        self.start, self.first, self.last, self.tokens = start, None, None, 0

    def line(self, line: str, now: float) -> None:
        if not line.startswith("data: {"):
            return
        data = json.loads(line[6:])
        if data.get("usage"):
            self.tokens = data["usage"]["completion_tokens"]
        elif data["choices"] and data["choices"][0]["delta"].get("content"):
            self.first = self.first or now
            self.last = now

    def result(self) -> dict:
        """TTFT (s), per-user tokens/s after the first token (None below two tokens), tokens."""
        span = (self.last or 0) - (self.first or 0)
        return {"ttft_s": (self.first or self.start) - self.start,
                "per_user_tok_s": (self.tokens - 1) / span if self.tokens > 1 and span > 0
                else None, "tokens": self.tokens}


async def in_process(args, bodies: list[dict]) -> list[dict]:
    """The routes of ``serve/app.py`` driven in this process (no HTTP, no Ray)."""
    from serve import app as serve_app
    from serve.openai_protocol import ChatCompletionRequest

    server_cls = serve_app.SpecServer.func_or_class.__mro__[1]  # under Serve's ingress wrapper
    server = server_cls(app_args(args))
    out = []
    try:
        for body in bodies:
            start = time.perf_counter()
            response = await server.chat_completions(ChatCompletionRequest(**body))
            clock = ChunkClock(start)
            async for chunk in response.body_iterator:
                now = time.perf_counter()
                for line in (chunk if isinstance(chunk, str) else chunk.decode()).splitlines():
                    clock.line(line, now)
            out.append(clock.result())
    finally:
        server.engine.shutdown()
    return out


async def over_http(url: str, bodies: list[dict]) -> list[dict]:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=300) as client:
        for body in bodies:
            clock = ChunkClock(time.perf_counter())
            async with client.stream("POST", url, json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    clock.line(line, time.perf_counter())
            out.append(clock.result())
    return out


def serve_arm(args, bodies: list[dict], direct: bool, work: Path) -> list[dict]:
    """``serve run`` of the same app in a fresh local Ray, measured over HTTP, then stopped."""
    import httpx

    config = {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1",
                                                              "port": args.port},
              "applications": [{"name": "bench", "route_prefix": "/",
                                "import_path": "serve.app:build_app",
                                "runtime_env": {"env_vars": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}},
                                "args": app_args(args)}]}
    path = work / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1" if direct else "0",
           # direct ingress: the replica's own port, from this range (Ray allocates it)
           "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(args.port + 1),
           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(args.port + 20),
           **dict(kv.split("=", 1) for kv in args.serve_env)}
    log = open(work / ("serve_direct.log" if direct else "serve_proxy.log"), "a")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", str(path)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    ports = range(args.port + 1, args.port + 21) if direct else [args.port]
    try:
        deadline, url = time.time() + 300, None
        while url is None:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited ({proc.returncode}); see {log.name}")
            for port in ports:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        url = f"http://127.0.0.1:{port}"
                        break
                except httpx.HTTPError:
                    pass
            if time.time() > deadline:
                raise RuntimeError("the server did not come up in 300 s")
            time.sleep(1)
        asyncio.run(over_http(f"{url}/v1/chat/completions", bodies[:2]))  # warm-up
        return asyncio.run(over_http(f"{url}/v1/chat/completions", bodies))
    finally:
        # SIGINT: `serve run` shuts Serve and the local Ray it started down (never `ray stop`,
        # which would end every Ray on the machine)
        stop_session(proc)


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for arm in ARMS:
        mine = [r for run in runs if run["arm"] == arm for r in run["requests"]]
        if not mine:
            continue
        speeds = [r["per_user_tok_s"] for r in mine if r["per_user_tok_s"]]
        rows.append({"arm": arm, "requests": len(mine),
                     "per_user_tok_s": statistics.mean(speeds),
                     "per_round": [statistics.mean(r["per_user_tok_s"] for r in run["requests"]
                                                   if r["per_user_tok_s"])
                                   for run in runs if run["arm"] == arm],
                     "ttft_s": statistics.mean(r["ttft_s"] for r in mine)})
    base = next((r for r in rows if r["arm"] == "in_process"), None)
    for r in rows:
        r["vs_in_process"] = r["per_user_tok_s"] / base["per_user_tok_s"] if base else None
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="~/.cache/dspark_ray/models/SmolLM2-135M-Instruct")
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--scheduler", default="none")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of the `serve run` arms (repeatable), e.g. "
                             "RAY_worker_niceness=0: Ray runs its workers, the replica too, at "
                             "niceness 15 unless told otherwise")
    parser.add_argument("--work", default="/tmp/dspark_http_tax")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    args = parser.parse_args()
    args.out = args.out or str(result_stem("http_tax"))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    arms = [a for a in args.arms.split(",") if a]
    bodies = [request_body(p, args) for p in prompts(args.requests)]
    runs, started = [], time.time()
    for k in range(args.rounds):
        for arm in (arms if k % 2 == 0 else arms[::-1]):
            if arm == "in_process":
                got = asyncio.run(in_process(args, bodies))
            else:
                got = serve_arm(args, bodies, arm == "serve_direct_ingress", work)
            runs.append({"arm": arm, "round": k, "requests": got})
            print(arm, k, statistics.mean(r["per_user_tok_s"] for r in got if r["per_user_tok_s"]),
                  flush=True)
    rows = summarize(runs)
    meta = {"date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - started),
            "machine": describe_machine(), "hardware": machine_fields(),
            "command": "python benchmarks/http_tax.py " + " ".join(sys.argv[1:]),
            "settings": {k: getattr(args, k) for k in ("drafter", "scheduler", "dtype", "threads",
                                                       "requests", "max_tokens", "temperature",
                                                       "rounds", "serve_env")},
            "client_niceness": os.nice(0)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs},
                                                   indent=1))
    lines = [f"# What HTTP costs one user (http_tax, measured {meta['date']})", "",
             f"Command: `{meta['command']}`. Machine: {meta['machine']}. Settings: "
             f"`{json.dumps(meta['settings'])}`. One stream; arms alternate over "
             f"{args.rounds} rounds.", "",
             "| arm | requests | per-user tok/s (mean) | per round | vs in-process | TTFT s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['requests']} | {r['per_user_tok_s']:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in r['per_round'])} | "
                     f"{r['vs_in_process']:.3f} | {r['ttft_s']:.3f} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print(Path(f"{out}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
