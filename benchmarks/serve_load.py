"""Serving under load: the DSpark scheduler vs no speculation, fixed gamma and a static threshold.

One Ray Serve app (``serve/app.py``, the real HTTP path) per verification policy is started with
the trained drafter and the real target, side by side; a load generator on 127.0.0.1 keeps C
concurrent streaming chat requests in flight (C = 1, 2, 4, ... 64), each point bounded in time and
request count, the policies taking turns at every C (``--repeats`` rounds, order rotated), so
slow drift of the machine hits every policy alike. Per point: aggregate tokens/s, mean per-user
tokens/s (decode speed after the first token), time to first token, and the mean verification budget
per request per step (verified draft tokens / rounds, from the engine's counters). Writes
``benchmarks/results/serve_load/<date>_<machine class>.{md,json}``, a Pareto plot (throughput vs per-user speed, paper
Figure 7), a budget-vs-concurrency plot (Figure 8), and the throughput each policy sustains at a
per-user SLA (its slowest request, or with ``--sla-quantile`` its p5 request, at or above it;
``--slas``; table and ``<same stem>_sla.png``, like the
paper's production table). A policy with a speed floor is a variant: the deployment's floor
(admission, prompt chunks and verification: ``dspark-min_tokens_per_s=12``, one deployment each)
or each request's own (``dspark+min_tokens_per_s=12``: the ``dspark`` deployment, every request
carrying ``min_tokens_per_s``, which orders drafting and verification and leaves admission to the
client's concurrency). Give one per SLA: the frontier table and the SLA plot read each
at its own floor as an SLA-aware policy, beside none and fixed, with every repeat read alone (the
spread).

    .venv/bin/python benchmarks/serve_load.py --drafter runs/drafter_quality/dspark/calibrate/drafter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from benchmarks.frontier_intervals import METHOD as INTERVAL_METHOD  # noqa: E402
from benchmarks.frontier_intervals import MIN_REPEATS, bootstrap_intervals, verdict  # noqa: E402
from drafters.precision import resolve_dtype_name  # noqa: E402

POLICIES = {
    "none": {"scheduler": "none"},
    "fixed": {"scheduler": "fixed"},
    "static_threshold": {"scheduler": "static_threshold", "threshold": 0.5},
    "dspark": {"scheduler": "dspark"},
}
PROMPT_SETS = ("mt-bench", "gsm8k", "humaneval", "alpaca")


def request_floor_of(policy: str) -> tuple[str, float | None]:
    """A request-floor variant's deployment and floor (``dspark+min_tokens_per_s=12`` ->
    ("dspark", 12.0)); any other policy: (itself, None).

    Raises:
        SystemExit: a ``+`` part other than ``min_tokens_per_s=<tokens/s above 0>``.
    """
    base, plus, override = policy.partition("+")
    if not plus:
        return policy, None
    field, _, value = override.partition("=")
    try:
        floor = float(value)
    except ValueError:
        floor = 0.0
    if field != "min_tokens_per_s" or not floor > 0:
        raise SystemExit(f"--policies: {policy!r}: a request floor is POLICY+min_tokens_per_s=N "
                         "with N > 0")
    return base, floor


def policy_engine(name: str) -> dict:
    """Engine settings of a policy: a name in POLICIES, or ``base-field=value`` for an engine
    variant measured beside it (e.g. ``dspark-probe_budget=0.01``), validated as the engine
    config would be; a request-floor variant (``dspark+min_tokens_per_s=12``) has its
    deployment's settings.

    Raises:
        SystemExit: an unknown policy, a variant that is not ``base-field=value`` or
            ``base+min_tokens_per_s=N``, or a field or value the engine config refuses.
    """
    from pydantic import ValidationError

    from serve.engine.config import EngineConfig

    name, _ = request_floor_of(name)
    base, _, override = name.partition("-")
    field, eq, value = override.partition("=")
    if base not in POLICIES or (override and (not eq or "=" in value)):
        raise SystemExit(f"--policies: {name!r} is not one of {sorted(POLICIES)} or "
                         "POLICY-field=value")
    engine = dict(POLICIES[base], **({field: value} if override else {}))
    try:
        return EngineConfig.model_validate(engine).model_dump(include=set(engine))
    except ValidationError as err:
        raise SystemExit(f"--policies: {name!r}: {err}") from err


def load_prompts(data_dir: Path, per_set: int, seed: int) -> list[str]:
    """First user turns of ``per_set`` prompts of each of :data:`PROMPT_SETS`, shuffled."""
    from pipeline.evaluate import load_eval_prompts

    prompts = []
    for name in PROMPT_SETS:
        prompts += load_eval_prompts(data_dir / f"{name}.jsonl", per_set, seed)
    random.Random(seed).shuffle(prompts)
    return prompts


async def sse_data(resp):
    """The ``data:`` payloads of a server-sent-event stream, split on line feeds only.

    httpx's ``aiter_lines`` also splits on U+2028, U+0085 and other characters that
    ``str.splitlines`` treats as line breaks; JSON may carry them unescaped inside a string, so a
    sampled token with one of them would cut a chunk in two.
    """
    buf = ""
    async for text in resp.aiter_text():
        buf += text
        *lines, buf = buf.split("\n")
        for line in lines:
            line = line.rstrip("\r")
            if line.startswith("data: "):
                yield line[6:]
    if buf.startswith("data: "):
        yield buf[6:].rstrip("\r")


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int,
                      seed: int | None = None, temperature: float = 1.0,
                      min_tokens_per_s: float | None = None):
    """Stream one chat completion; returns (ttft_s, total_s, completion_tokens, decode_s,
    engine_decode_tokens_per_s): the last is the engine's own view of the request's decode speed
    (its ``spec_details``; None for a one-token answer), set beside the client's to tell the
    engine's pace from the serving path's. Unseeded by default, as most production traffic is: a
    seeded request samples load-invariantly
    (``serve.engine.config.EngineConfig.seeded_sampling``), which accepts less.
    ``min_tokens_per_s``: the request's own speed floor (None: none sent)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "return_spec_details": True}
    if seed is not None:
        body["seed"] = seed
    if min_tokens_per_s is not None:
        body["min_tokens_per_s"] = min_tokens_per_s
    start = time.perf_counter()
    first = None
    tokens, engine_speed = 0, None
    async with client.stream("POST", url, json=body, timeout=600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for data in sse_data(resp):
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("spec_details"):
                engine_speed = chunk["spec_details"]["engine_decode_tokens_per_s"]
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return first - start, end - start, tokens, end - first, engine_speed


def sla_speed(speeds: list[float], quantile: float = 0.0) -> float:
    """The per-user speed a point's SLA is checked against: the slowest request
    (``quantile`` 0) or the ``quantile`` of the requests' speeds (e.g. 0.05: p5; linear between
    the closest ranks); 0.0 without requests.

    Raises:
        ValueError: ``quantile`` outside [0, 0.5).
    """
    if not 0.0 <= quantile < 0.5:
        raise ValueError(f"the SLA quantile must be in [0, 0.5), got {quantile}")
    if not speeds:
        return 0.0
    ordered = sorted(speeds)
    pos = quantile * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _sla_speed_of(point: dict) -> float:
    """A point's SLA speed (points written before ``sla_speed_tok_s``: its slowest request)."""
    return point.get("sla_speed_tok_s", point["per_user_tok_s_min"])


async def run_point(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                    duration_s: float, max_requests: int, temperature: float = 1.0,
                    min_tokens_per_s: float | None = None, sla_quantile: float = 0.0) -> dict:
    """Keep ``concurrency`` requests in flight until ``duration_s`` or ``max_requests``, each
    carrying ``min_tokens_per_s`` when given; ``sla_quantile``: :func:`sla_speed`'s."""
    import httpx

    results, counter = [], {"next": 0}
    start = time.perf_counter()

    async def worker(client):
        while time.perf_counter() - start < duration_s and counter["next"] < max_requests:
            i = counter["next"]
            counter["next"] += 1
            results.append(await one_request(client, url, model, prompts[i % len(prompts)],
                                             max_tokens, temperature=temperature,
                                             min_tokens_per_s=min_tokens_per_s))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    per_user = [(r[2] - 1) / r[3] for r in results if r[2] > 1 and r[3] > 0]
    engine_speeds = [r[4] for r in results if r[4] is not None]
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "completion_tokens": tokens, "throughput_tok_s": tokens / wall,
            "per_user_tok_s": statistics.mean(per_user) if per_user else 0.0,
            # the slowest request of the point (the SLA test at --sla-quantile 0)
            "per_user_tok_s_min": min(per_user) if per_user else 0.0,
            # what the SLA is checked against (sla_speed), and every request's speed
            "sla_speed_tok_s": sla_speed(per_user, sla_quantile),
            "per_user_speeds": [round(v, 3) for v in per_user],
            # the slowest request as the engine measured it (no HTTP in between; it may be
            # another request than the client's slowest); None: no request reported one
            "engine_tok_s_min": min(engine_speeds) if engine_speeds else None,
            "ttft_s_mean": statistics.mean(r[0] for r in results),
            "ttft_s_p50": statistics.median(r[0] for r in results)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(name: str, args):
    """Start policy ``name``'s Serve app at ``/<name>`` (all policies stay up side by side, so
    their points can alternate; an idle engine thread sleeps) and warm it up."""
    from ray import serve

    from serve.app import build_app

    engine = {"max_num_requests": max(args.concurrency), "max_waiting": max(args.concurrency),
              "max_batch_tokens": args.max_batch_tokens, "max_model_len": 1024,
              "kv_cache_memory_gib": args.kv_cache_gib, **policy_engine(name)}
    app_args = {"target": args.target, "drafter": args.drafter, "dtype": args.dtype,
                "served_model_name": "bench", "num_threads": args.threads,
                # Ray's bookkeeping only: the apps take turns, one runs at a time
                "num_cpus": 0.25, "engine": engine}
    return serve.run(build_app(app_args), name=f"bench-{name}", route_prefix=f"/{route(name)}")


def route(name: str) -> str:
    """The URL path segment of a policy (a variant's "=" and "." are not path-safe)."""
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name)


def measure(name: str, handle, args, prompts: list[str], port: int, concurrency: int,
            repeat: int) -> dict:
    """One point: ``concurrency`` streams against policy ``name`` for ``duration_s`` (a
    request-floor variant: its deployment, every request carrying the floor)."""
    deployment, floor = request_floor_of(name)
    url = f"http://127.0.0.1:{port}/{route(deployment)}/v1/chat/completions"
    before = handle.engine_state.remote().result()["stats"]
    point = asyncio.run(run_point(url, "bench", prompts, concurrency, args.max_tokens,
                                  args.duration_s, max(args.min_requests, 2 * concurrency),
                                  args.temperature, floor, args.sla_quantile))
    after = handle.engine_state.remote().result()["stats"]
    rounds = after["rounds"] - before["rounds"]
    point["mean_verification_budget"] = ((after["verified_tokens"] - before["verified_tokens"])
                                         / rounds if rounds else 0.0)
    point["tau"] = (after["committed_tokens"] - before["committed_tokens"]) / rounds if rounds else 0.0
    point["steps"] = after["steps"] - before["steps"]
    point["policy"], point["repeat"] = name, repeat
    logging.info("%s C=%d #%d: %.1f tok/s, %.2f tok/s/user, budget %.2f, TTFT %.2f s", name,
                 concurrency, repeat, point["throughput_tok_s"], point["per_user_tok_s"],
                 point["mean_verification_budget"], point["ttft_s_mean"])
    return point


def summarize(runs: list[dict], policies: list[str], concurrency: list[int],
              sla_quantile: float = 0.0) -> list[dict]:
    """Per (policy, concurrency): means over the repeats, the slowest request over them, and the
    SLA speed (:func:`sla_speed`) of every request of every repeat pooled."""
    points = []
    for name in policies:
        for c in concurrency:
            rs = [r for r in runs if r["policy"] == name and r["concurrency"] == c]
            point = {"policy": name, "concurrency": c, "repeats": len(rs),
                     "requests": sum(r["requests"] for r in rs)}
            for key in ("throughput_tok_s", "per_user_tok_s", "ttft_s_mean",
                        "mean_verification_budget", "tau"):
                point[key] = statistics.mean(r[key] for r in rs)
            # every request of every repeat: the slowest one
            point["per_user_tok_s_min"] = min(r["per_user_tok_s_min"] for r in rs)
            pooled = [v for r in rs for v in r.get("per_user_speeds", [])]
            point["sla_speed_tok_s"] = (sla_speed(pooled, sla_quantile) if pooled
                                        else point["per_user_tok_s_min"])
            engine = [r["engine_tok_s_min"] for r in rs if r.get("engine_tok_s_min") is not None]
            point["engine_tok_s_min"] = min(engine) if engine else None
            point["throughput_tok_s_each"] = [round(r["throughput_tok_s"], 2) for r in rs]
            points.append(point)
    return points


def paired_ratios(runs: list[dict], concurrency: list[int]) -> dict:
    """dspark / max(none, fixed) aggregate throughput and dspark / none per-user speed, per
    concurrency and repeat (each ratio from points of one repeat, run back to back)."""
    out = {}
    by = {(r["policy"], r["concurrency"], r["repeat"]): r for r in runs}
    for c in concurrency:
        reps = sorted({r["repeat"] for r in runs if r["concurrency"] == c})
        thr, user = [], []
        for k in reps:
            d, n, f = (by.get((p, c, k)) for p in ("dspark", "none", "fixed"))
            if d and n:
                base = max(n["throughput_tok_s"], f["throughput_tok_s"] if f else 0.0)
                thr.append(d["throughput_tok_s"] / base)
                user.append(d["per_user_tok_s"] / max(1e-9, n["per_user_tok_s"]))
        out[c] = {"throughput_vs_best_baseline": thr, "per_user_vs_none": user}
    return out


def throughput_at_sla(points: list[dict], policy: str, sla: float) -> dict:
    """The most aggregate tokens/s ``policy`` sustains with its requests at or above ``sla``
    per-user tokens/s, read off its measured points (each point's SLA speed decides: its slowest
    request, or the quantile ``--sla-quantile`` names).

    Returns:
        {"measured": the best throughput among points whose SLA speed holds the SLA (None:
        no point does), "concurrency": that point's, "interpolated": the throughput where the
        straight line between a point that holds the SLA and the next concurrency's point that
        does not crosses it (None when no such pair exists; then "measured" is the answer)}.
    """
    ps = sorted((p for p in points if p["policy"] == policy), key=lambda p: p["concurrency"])
    holding = [p for p in ps if _sla_speed_of(p) >= sla]
    best = max(holding, key=lambda p: p["throughput_tok_s"]) if holding else None
    interpolated = None
    for a, b in zip(ps, ps[1:]):
        ua, ub = _sla_speed_of(a), _sla_speed_of(b)
        if ua >= sla > ub:
            t = a["throughput_tok_s"] + (b["throughput_tok_s"] - a["throughput_tok_s"]) * (
                (ua - sla) / (ua - ub))
            interpolated = t if interpolated is None else max(interpolated, t)
    if interpolated is not None and best is not None:
        interpolated = max(interpolated, best["throughput_tok_s"])
    return {"measured": best["throughput_tok_s"] if best else None,
            "concurrency": best["concurrency"] if best else None, "interpolated": interpolated}


def default_slas(points: list[dict], count: int = 3) -> list[float]:
    """SLAs spread over the range the measured points cover: ``count`` per-user speeds evenly
    between the slowest and fastest points' SLA speeds (rounded to 0.1 tok/s)."""
    speeds = [_sla_speed_of(p) for p in points if _sla_speed_of(p) > 0]
    if not speeds:
        return []
    lo, hi = min(speeds), max(speeds)
    return [round(lo + (hi - lo) * (i + 1) / (count + 1), 1) for i in range(count)]


def sla_rows(points: list[dict], slas: list[float]) -> list[dict]:
    """Per SLA and policy: :func:`throughput_at_sla`."""
    policies = list(dict.fromkeys(p["policy"] for p in points))
    return [{"sla_tok_s": sla, "policy": name, **throughput_at_sla(points, name, sla)}
            for sla in slas for name in policies]


def sla_test_subject(quantile: float = 0.0) -> str:
    """Whose speed a point's SLA was checked against, as a table's sentence names it
    (``--sla-quantile``; :func:`sla_test_text` is the report's header sentence)."""
    if quantile <= 0:
        return "its slowest request"
    return (f"its p{quantile * 100:g} request (the {quantile * 100:g} % quantile of every "
            "request's decode speed, the repeats pooled; a repeat read alone: its own requests)")


def render_sla_md(rows: list[dict], quantile: float = 0.0) -> list[str]:
    if not rows:
        return []
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines = ["", "## Throughput at a per-user SLA", "",
             "The most aggregate tokens/s each policy sustained with "
             + ("every request (its decode speed after the first token)" if quantile <= 0
                else sla_test_subject(quantile))
             + " at or above the SLA: the best measured point (its "
             "concurrency), and the straight-line interpolation between the last concurrency "
             "that held the SLA and the next one that did not ('-': none held it).", "",
             "| SLA per-user tok/s | policy | throughput, measured (concurrency) | "
             "interpolated |", "|---|---|---|---|"]
    for r in rows:
        conc = f" ({r['concurrency']})" if r["concurrency"] is not None else ""
        lines.append(f"| {r['sla_tok_s']:g} | {r['policy']} | {fmt(r['measured'])}{conc} | "
                     f"{fmt(r['interpolated'])} |")
    return lines


def floor_of(policy: str) -> float | None:
    """The per-user speed floor a policy variant sets, the deployment's
    (``dspark-min_tokens_per_s=12`` -> 12.0) or its requests' (``dspark+min_tokens_per_s=12``),
    else None."""
    deployment, floor = request_floor_of(policy)
    if floor is not None:
        return floor
    _, _, override = deployment.partition("-")  # one override per variant (policy_engine's rule)
    field, _, value = override.partition("=")
    return float(value) if field == "min_tokens_per_s" else None


#: the frontier rows composed of the floor variants, each read at its own floor: what a user who
#: sets ``engine.min_tokens_per_s`` to their SLA gets (issue 43), and what a user gets whose
#: requests carry their SLA as ``min_tokens_per_s``
SLA_AWARE = "dspark (floor = SLA)"
SLA_AWARE_REQUEST = "dspark (request floor = SLA)"


def sla_aware_label(policy: str) -> str | None:
    """The frontier row a floor variant belongs to (None: a policy without a floor)."""
    if floor_of(policy) is None:
        return None
    return SLA_AWARE_REQUEST if request_floor_of(policy)[1] is not None else SLA_AWARE


def frontier_rows(points: list[dict], runs: list[dict], slas: list[float]) -> list[dict]:
    """The frontier (issue 43, the DSpark paper's production table): per SLA, the throughput at
    it (:func:`throughput_at_sla`) of every policy without a speed floor and of :data:`SLA_AWARE`
    and :data:`SLA_AWARE_REQUEST`, the floor variants whose floor equals that SLA (none measured:
    no row). Each row carries the
    reading of every repeat alone (``each``: the repeat's own points, its SLA speed deciding)
    beside the reading of the repeats' means (the SLA speed of the repeats' requests pooled).

    Args:
        points: :func:`summarize`'s points (means over the repeats).
        runs: every measured run, with ``repeat``.
        slas: per-user speeds (tokens/s).

    Returns:
        [{"sla_tok_s", "policy", "measured", "concurrency", "interpolated", "each": [measured
        per repeat, None where that repeat held the SLA nowhere]}], SLA by SLA.
    """
    repeats = sorted({r["repeat"] for r in runs})
    plain = [n for n in dict.fromkeys(p["policy"] for p in points) if floor_of(n) is None]
    rows = []
    for sla in slas:
        names = [(n, n) for n in plain]
        names += [(sla_aware_label(n), n) for n in dict.fromkeys(p["policy"] for p in points)
                  if floor_of(n) is not None and abs(floor_of(n) - sla) < 1e-9]
        for label, name in names:
            each = [throughput_at_sla([r for r in runs if r["repeat"] == k], name, sla)["measured"]
                    for k in repeats]
            rows.append({"sla_tok_s": sla, "policy": label, "variant": name,
                         **throughput_at_sla(points, name, sla), "each": each})
    return rows


def frontier_ratio(rows: list[dict], sla: float, aware_label: str = SLA_AWARE) -> dict | None:
    """An SLA-aware row's (``aware_label``) measured throughput at ``sla`` over the best of the
    policies without speculation or with a fixed gamma (``none``, ``fixed``, ``fixed-...``), from
    the repeats' means and per repeat (None: a side held the SLA nowhere, or no such row)."""
    at = [r for r in rows if r["sla_tok_s"] == sla]
    aware = next((r for r in at if r["policy"] == aware_label), None)
    base = [r for r in at if r["policy"] == "none" or r["policy"].startswith("fixed")]
    if aware is None or not base:
        return None

    def ratio(mine, theirs):
        theirs = [t for t in theirs if t is not None]
        if not theirs:
            return None
        return (mine or 0.0) / max(theirs)

    return {"means": ratio(aware["measured"], [b["measured"] for b in base]),
            "each": [ratio(aware["each"][k], [b["each"][k] for b in base])
                     for k in range(len(aware["each"]))]}


#: bootstrap draws of the frontier intervals
BOOTSTRAP_DRAWS = 1000


def frontier_ratios(runs: list[dict], slas: list[float], quantile: float = 0.0
                    ) -> dict[tuple[str, float], float | None]:
    """Per SLA-aware row and SLA, its throughput at the SLA over the best of none and fixed,
    read off the repeats' means (:func:`frontier_ratio`'s ``means``) of ``runs``: the statistic
    :func:`benchmarks.frontier_intervals.bootstrap_intervals` resamples.

    Returns:
        {(label, sla): ratio; inf where the SLA-aware row held the SLA and neither none nor fixed
        did; None where none of them did}; a label without a floor variant at that SLA has no key.
    """
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    concurrency = sorted({r["concurrency"] for r in runs})
    rows = frontier_rows(summarize(runs, policies, concurrency, quantile), runs, slas)
    out = {}
    for sla in slas:
        for label in (SLA_AWARE, SLA_AWARE_REQUEST):
            ratio = frontier_ratio(rows, sla, label)
            if ratio is None:
                continue
            mine = next(r["measured"] for r in rows if r["sla_tok_s"] == sla
                        and r["policy"] == label)
            out[(label, sla)] = (ratio["means"] if ratio["means"] is not None
                                 else math.inf if mine is not None else None)
    return out


def frontier_intervals(runs: list[dict], slas: list[float], quantile: float = 0.0,
                       draws: int = BOOTSTRAP_DRAWS
                       ) -> dict[tuple[str, float], tuple[float, float] | None]:
    """95 % bootstrap intervals of :func:`frontier_ratios`; {} (no interval claimed) with fewer
    than :data:`~benchmarks.frontier_intervals.MIN_REPEATS` repeats, a slowest-request SLA test
    (``quantile`` 0: a resampled minimum is never below the measured one), or runs without
    their requests' speeds, which the resampling needs."""
    if (len({r["repeat"] for r in runs}) < MIN_REPEATS or quantile <= 0
            or not all(r.get("per_user_speeds") for r in runs)):
        return {}
    return bootstrap_intervals(runs, lambda rs: frontier_ratios(rs, slas, quantile), draws)


def render_frontier_md(rows: list[dict], quantile: float = 0.0,
                       intervals: dict | None = None) -> list[str]:
    aware = [a for a in (SLA_AWARE_REQUEST, SLA_AWARE) if any(r["policy"] == a for r in rows)]
    if not aware:
        return []
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lines = ["", "## The frontier: throughput at each per-user SLA", "",
             f"Per SLA, the most aggregate tokens/s each policy sustained with "
             f"{sla_test_subject(quantile)} at or above the SLA, best measured point (concurrency), "
             f"then each repeat read "
             f"alone in brackets ('-': no point held it). `{SLA_AWARE}` is the "
             "`dspark-min_tokens_per_s=SLA` deployment read at its own floor (admission, prompt "
             f"chunks and verification under the floor); `{SLA_AWARE_REQUEST}` the `dspark` "
             "deployment whose requests carry `min_tokens_per_s` = SLA (drafting and "
             "verification under the floor, admission left to the clients' concurrency). The "
             "last columns: each SLA-aware row over the best of none and fixed (means; each "
             "repeat" + (f"; then its {INTERVAL_METHOD} interval and whether it lies above 1, "
                         "below 1, or holds it: a tie" if intervals else "") + ").", "",
             "| SLA tok/s | " + " | ".join(policies) + "".join(
                 f" | {a} / best of none, fixed" for a in aware) + " |",
             "|---|" + "---|" * (len(policies) + len(aware))]
    for sla in dict.fromkeys(r["sla_tok_s"] for r in rows):
        at = {r["policy"]: r for r in rows if r["sla_tok_s"] == sla}
        cells = []
        for name in policies:
            r = at.get(name)
            if r is None:
                cells.append("n/a")
                continue
            conc = f" ({r['concurrency']})" if r["concurrency"] is not None else ""
            cells.append(f"{fmt(r['measured'])}{conc} [{', '.join(fmt(v) for v in r['each'])}]")
        ratios = []
        for label in aware:
            ratio = frontier_ratio(rows, sla, label)
            cell = "n/a" if ratio is None or ratio["means"] is None else (
                f"{ratio['means']:.2f} "
                f"[{', '.join('-' if v is None else f'{v:.2f}' for v in ratio['each'])}]")
            if intervals and (label, sla) in intervals:
                band = intervals[(label, sla)]
                cell += ("; 95 %: n/a" if band is None else
                         f"; 95 %: {band[0]:.2f}-{band[1]:.2f}, {verdict(band)}")
            ratios.append(cell)
        lines.append(f"| {sla:g} | " + " | ".join(cells + ratios) + " |")
    return lines


def fmt_speed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def render_floor_md(points: list[dict]) -> list[str]:
    """Per policy with a speed floor: at each concurrency, its slowest request against the floor
    (the engine queues what it cannot admit at the floor, so slow requests there are misses)."""
    rows = [(p, floor_of(p["policy"])) for p in points if floor_of(p["policy"]) is not None]
    if not rows:
        return []
    lines = ["", "## Speed floor check", "",
             "Every finished request's decode speed (tokens after the first over the time from "
             "the first to the last) against the floor its policy sets; requests the admission "
             "held back waited in the queue (their wait is in TTFT, not in the decode speed). "
             "The engine's column is the slowest request by the engine's own clock "
             "(`spec_details.engine_decode_tokens_per_s`, no HTTP in between; not necessarily "
             "the request the client read slowest; n/a: none reported).",
             "", "| policy | concurrency | floor tok/s | slowest request tok/s (client) | "
             "slowest request tok/s (engine) | held |",
             "|---|---|---|---|---|---|"]
    for p, floor in rows:
        lines.append(f"| {p['policy']} | {p['concurrency']} | {floor:g} | "
                     f"{p['per_user_tok_s_min']:.2f} | {fmt_speed(p.get('engine_tok_s_min'))} | "
                     f"{'yes' if p['per_user_tok_s_min'] >= floor else 'no'} |")
    return lines


def sla_test_text(quantile: float) -> str:
    """The sentence saying what a point's SLA is checked against."""
    if quantile <= 0:
        return "The SLA test: a point's slowest request."
    return (f"The SLA test: the p{100 * quantile:g} (the {100 * quantile:g} % quantile) of a "
            "point's per-user speeds "
            "(the requests of its repeats pooled; each repeat read alone for the spread).")


def render_md(points: list[dict], ratios: dict, meta: dict, runs: list[dict] = (),
              intervals: dict | None = None) -> str:
    """The results markdown; ``intervals``: :func:`frontier_intervals` (None: no interval
    column)."""
    lines = ["# Serving under load: verification policies side by side", "",
             f"Target `{meta['target']}` ({meta['dtype']}), drafter `{meta['drafter']}`; "
             f"{meta['max_tokens']} new tokens per request at temperature {meta['temperature']:g} "
             f"(0 = greedy), prompts from "
             f"{', '.join(PROMPT_SETS)}; each point starts requests for {meta['duration_s']} s "
             f"or until max({meta['min_requests']}, 2 x concurrency) have started; all policies are deployed side by side and, per "
             f"concurrency, the policies alternate {meta['repeats']} times (order rotated); "
             f"tables give means over the repeats. Machine: {meta['machine']}. Total "
             f"{meta['wall_minutes']:.1f} min. Command: `{meta['command']}`. "
             + sla_test_text(meta.get("sla_quantile", 0.0)), "",
             "| policy | concurrency | requests | throughput tok/s (each repeat) | per-user tok/s "
             "| slowest request tok/s | TTFT mean s | verification budget / request / step | tau |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        each = ", ".join(f"{v:.1f}" for v in p["throughput_tok_s_each"])
        lines.append(f"| {p['policy']} | {p['concurrency']} | {p['requests']} | "
                     f"{p['throughput_tok_s']:.1f} ({each}) | {p['per_user_tok_s']:.2f} | "
                     f"{p['per_user_tok_s_min']:.2f} | "
                     f"{p['ttft_s_mean']:.2f} | {p['mean_verification_budget']:.2f} | "
                     f"{p['tau']:.2f} |")
    quantile = meta.get("sla_quantile", 0.0)
    lines += render_sla_md(sla_rows(points, meta.get("slas") or []), quantile)
    lines += render_frontier_md(frontier_rows(points, runs, meta.get("slas") or []), quantile,
                                intervals)
    lines += render_floor_md(points)
    by = {(p["policy"], p["concurrency"]): p for p in points}
    if not all((n, c) in by for n in ("none", "dspark") for c in meta["concurrency"]):
        return "\n".join(lines) + "\n"
    lines += ["", "## Done-when checks", "",
              "| concurrency | dspark / best of none, fixed (throughput of the means) | per repeat "
              "| dspark / none per-user tok/s | per repeat |", "|---|---|---|---|---|"]
    for c in meta["concurrency"]:
        base = max(by[(n, c)]["throughput_tok_s"] for n in ("none", "fixed") if (n, c) in by)
        user = by[("dspark", c)]["per_user_tok_s"] / max(1e-9, by[("none", c)]["per_user_tok_s"])
        r = ratios[c]
        lines.append(f"| {c} | {by[('dspark', c)]['throughput_tok_s'] / base:.3f} | "
                     f"{', '.join(f'{v:.3f}' for v in r['throughput_vs_best_baseline'])} | "
                     f"{user:.3f} | {', '.join(f'{v:.3f}' for v in r['per_user_vs_none'])} |")
    lines += ["", "Goals (issue 10): throughput ratio >= 0.97 at every concurrency; per-user "
              "ratio >= 1.2 at concurrency 1."]
    return "\n".join(lines) + "\n"


def plots(points: list[dict], out: Path, slas: list[float] | None = None,
          runs: list[dict] = (), quantile: float = 0.0) -> None:
    """The Pareto, budget and (with ``slas``) SLA plots at ``<out>_pareto.png``, ``_budget.png``
    and ``_sla.png`` (``out``: the run's files' path without a suffix)."""
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
    fig.savefig(f"{out}_pareto.png", dpi=120)
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
    fig.savefig(f"{out}_budget.png", dpi=120)
    if slas:
        fig = Figure(figsize=(6.4, 4.0))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        rows = frontier_rows(points, runs, sorted(slas))
        for name in dict.fromkeys(r["policy"] for r in rows):
            got = [(r["sla_tok_s"], r["measured"], [v for v in r["each"] if v is not None])
                   for r in rows if r["policy"] == name and r["measured"] is not None]
            if got:  # nothing drawn where no point held the SLA
                xs, ys, each = zip(*got)
                ax.plot(xs, ys, "o-", label=name)
                low = [min(e, default=y) for e, y in zip(each, ys)]
                high = [max(e, default=y) for e, y in zip(each, ys)]
                ax.fill_between(xs, low, high, alpha=0.15)  # the repeats' spread
        ax.set_xlabel("per-user SLA (tokens/s, "
                      + (f"p{quantile * 100:g} request)" if quantile > 0 else "slowest request)"))
        ax.set_ylabel("aggregate tokens/s at the SLA")
        ax.set_title("Throughput at a per-user SLA (band: repeats)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{out}_sla.png", dpi=120)


def write_results(out: Path, meta: dict, runs: list[dict], readings: str = "") -> str:
    """Write ``<out>.json``, ``<out>.md`` and the plots from the measured ``runs`` and the run's
    ``meta``; ``readings``: text kept after the tables (a re-render's ``## Reading`` sections).
    Returns the markdown."""
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    # results written before these keys: the slowest request decided, SLAs spread over the range
    quantile = meta.setdefault("sla_quantile", 0.0)
    points = summarize(runs, policies, meta["concurrency"], quantile)
    if meta.get("slas") is None:
        meta["slas"] = default_slas(points)
    ratios = paired_ratios(runs, meta["concurrency"])
    intervals = frontier_intervals(runs, meta["slas"], quantile)
    # the markdown and the plots first: a failure there leaves the JSON as it was
    md = render_md(points, ratios, meta, runs, intervals) + (
        f"\nPlots: `{out.name}_pareto.png` (throughput against per-user speed), "
        f"`{out.name}_budget.png` (verification budget)"
        + (f", `{out.name}_sla.png` (throughput at each SLA)" if meta["slas"] else "") + ".\n")
    plots(points, out, meta["slas"], runs, quantile)
    Path(f"{out}.md").write_text(md + readings)
    Path(f"{out}.json").write_text(json.dumps(
        {"meta": meta, "points": points, "ratios": {str(c): r for c, r in ratios.items()},
         "sla": sla_rows(points, meta["slas"]),
         "frontier": frontier_rows(points, runs, meta["slas"]),
         # an unbounded end (draws where only the SLA-aware row held the SLA) written as "inf"
         "frontier_intervals": [{"policy": label, "sla_tok_s": sla, "ratio_95": band and [
                                    v if math.isfinite(v) else "inf" for v in band],
                                 "verdict": verdict(band), "method": INTERVAL_METHOD,
                                 "repeats": len({r["repeat"] for r in runs}),
                                 "draws": BOOTSTRAP_DRAWS}
                                for (label, sla), band in intervals.items()],
         "runs": runs}, indent=1))
    return md


def rerender(json_path: Path) -> str:
    """Rewrite a finished run's files from its JSON (its runs and meta as measured, the tables
    and plots as this script now computes them), keeping the ``## Reading`` sections of its
    markdown.

    Raises:
        SystemExit: the file is missing, is not a serve_load result (no ``runs``/``meta``), or
            lacks a field this script needs (named).
    """
    try:
        saved = json.loads(json_path.read_text())
        meta, runs = saved["meta"], saved["runs"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"--from-json {json_path}: not a serve_load result ({err})") from err
    out = json_path.with_suffix("")
    md_path = Path(f"{out}.md")
    old = md_path.read_text() if md_path.exists() else ""
    readings = old[old.index("\n## Reading"):] if "\n## Reading" in old else ""
    try:
        return write_results(out, meta, runs, readings)
    except KeyError as err:
        raise SystemExit(f"--from-json {json_path}: written before this script kept {err}; "
                         "measure it again") from err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="~/.cache/dspark_ray/models/SmolLM2-135M-Instruct")
    parser.add_argument("--drafter", default="runs/drafter_quality/dspark/calibrate/drafter")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature of every request (0 = greedy)")
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--duration-s", type=float, default=25.0)
    parser.add_argument("--kv-cache-gib", type=float, default=1.5,
                        help="each deployment's KV pool (allocated at start: a 12-policy frontier "
                             "at the default would hold 18 GiB)")
    parser.add_argument("--min-requests", type=int, default=4,
                        help="a point also ends once max(this, 2 x concurrency) requests have "
                        "started (a large value lets --duration-s alone decide)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="times each point is measured, the policies alternating")
    parser.add_argument("--slas", type=lambda s: [float(x) for x in s.split(",")], default=None,
                        help="per-user tokens/s SLAs for the throughput-at-SLA table (default: "
                        "three spread over the measured range)")
    parser.add_argument("--sla-quantile", type=float, default=0.0,
                        help="the per-user speed a point's SLA is checked against: 0 = its "
                        "slowest request, 0.05 = the 5th percentile of its requests (pooled over "
                        "the repeats; a steadier test where one request decides)")
    parser.add_argument("--data-dir", default=str(ROOT / "infra" / "datasets" / "eval"))
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--from-json", type=Path, default=None,
                        help="measure nothing: rewrite this finished run's markdown, JSON and "
                        "plots from its JSON (its readings kept)")
    args = parser.parse_args()
    if args.from_json is not None:
        print(rerender(args.from_json))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    started = time.time()
    prompts = load_prompts(Path(args.data_dir), 40, 0)
    policies = args.policies.split(",")
    try:
        sla_speed([], args.sla_quantile)
    except ValueError as err:
        raise SystemExit(f"--sla-quantile: {err}") from err
    for name in policies:
        policy_engine(name)  # an unknown policy fails here, before anything starts
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    runs = []
    try:
        # a request-floor variant is measured on its deployment: one app per deployment
        deployments = list(dict.fromkeys(request_floor_of(name)[0] for name in policies))
        apps = {name: deploy(name, args) for name in deployments}
        handles = {name: apps[request_floor_of(name)[0]] for name in policies}
        for name in deployments:  # warm-up
            asyncio.run(run_point(f"http://127.0.0.1:{port}/{route(name)}/v1/chat/completions",
                                  "bench", prompts, 2, args.max_tokens, 60, 2, args.temperature))
        for i, c in enumerate(args.concurrency):
            for k in range(args.repeats):
                shift = (i + k) % len(policies)
                for name in policies[shift:] + policies[:shift]:
                    runs.append(measure(name, handles[name], args, prompts, port, c, k))
    finally:
        serve.shutdown()
        ray.shutdown()
    points = summarize(runs, policies, args.concurrency, args.sla_quantile)
    out = Path(args.out or result_stem("serve_load"))  # the files' path without a suffix
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"target": args.target, "drafter": args.drafter, "dtype": resolve_dtype_name(args.dtype),
            "max_tokens": args.max_tokens, "temperature": args.temperature,
            "duration_s": args.duration_s,
            "min_requests": args.min_requests, "concurrency": args.concurrency,
            "repeats": args.repeats, "sla_quantile": args.sla_quantile,
            "machine": describe_machine(), "hardware": machine_fields(),
            "date": time.strftime("%Y-%m-%d"), "wall_minutes": (time.time() - started) / 60,
            "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:])}
    meta["slas"] = args.slas if args.slas is not None else default_slas(points)
    print(write_results(out, meta, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
